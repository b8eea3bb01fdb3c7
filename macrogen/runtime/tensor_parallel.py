"""Sharded layers for ``@tensor_parallel``: one small module per parallel style.

Each layer is built from the full serial layer (the one the user's ``__init__``
made, with the serial initialization) and keeps only this rank's shard, under
the serial parameter names (``weight``, ``bias``), so ``state_dict()`` keys are
the serial ones. ``SHARD_DIMS`` says along which dimension each parameter is
split; ``full_state_dict`` and ``load_full_state_dict`` use it to move
checkpoints between serial and tensor-parallel runs.

    style      layer          weight shard            forward
    colwise    nn.Linear      rows (out features)     f(x) @ W_r.T + b_r        -> output sharded on the last dim
    rowwise    nn.Linear      columns (in features)   g(x_r @ W_r.T) + b        -> output full (bias added once)
    vocab      nn.Embedding   rows (vocabulary)       g(mask(E_r[ids - start])) -> output full

With sequence parallelism (``sequence=True``) a colwise layer all-gathers its
input along the sequence (dim 1) first, and a rowwise layer reduce-scatters
its output along the sequence instead of all-reducing it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from macrogen.runtime.collectives import (
    colwise_from_sequence,
    colwise_linear,
    group_rank,
    group_size,
    reduce_from_tensor_parallel,
    rowwise_linear,
    rowwise_to_sequence,
    scatter_last_dim,
)


def is_conv1d(layer: Any) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): an ``nn.Linear`` with its weight stored ``(in, out)``,
    found by its ``nf`` (out features) attribute and its weight's shape."""
    weight, nf = getattr(layer, "weight", None), getattr(layer, "nf", None)
    return (
        isinstance(layer, nn.Module)
        and not isinstance(layer, nn.Linear)
        and isinstance(nf, int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == nf
    )


def _linear_sizes(full: nn.Module) -> tuple[int, int, bool]:
    """(in features, out features, whether the weight is stored (in, out): an HF Conv1D)."""
    if is_conv1d(full):
        rows, cols = cast(torch.Tensor, full.weight).shape  # (in, out)
        return int(rows), int(cols), True
    assert isinstance(full, nn.Linear)
    return full.in_features, full.out_features, False


def _shard_size(full: int, group: dist.ProcessGroup | None, what: str) -> int:
    size = group_size(group)
    if full % size:
        raise ValueError(
            f"{what} = {full} is not divisible by the tensor-parallel size {size};"
            f" choose a size that divides it"
        )
    return full // size


def split(
    t: torch.Tensor, dim: int, group: dist.ProcessGroup | None, blocks: int = 1
) -> torch.Tensor:
    """This rank's shard of a full tensor: its slice of each of ``blocks`` packed blocks along ``dim``."""
    size, rank = group_size(group), group_rank(group)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in t.chunk(blocks, dim=dim)], dim=dim)


def join(parts: list[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (``split``'s inverse)."""
    per_rank = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([torch.cat([p[b] for p in per_rank], dim=dim) for b in range(blocks)], dim=dim)


def make_shard(
    t: torch.Tensor | None, dim: int, group: dist.ProcessGroup | None, blocks: int = 1
) -> Any:
    """This rank's shard of a full parameter, as a new parameter."""
    if t is None:
        return None
    part = split(t.detach(), dim, group, blocks)
    return nn.Parameter(part.clone(), requires_grad=t.requires_grad)


def _shard(
    t: torch.Tensor | None,
    dim: int,
    group: dist.ProcessGroup | None,
    blocks: int,
    name: str,
    shard: Any,
) -> Any:
    # ``shard``: the planner's cache, so that a parameter tied between layers gets one shard
    return (
        make_shard(t, dim, group, blocks) if shard is None else shard(t, dim, blocks, group, name)
    )


class _Sharded(nn.Module):
    """A sharded layer: it holds its process group, which copies share (a group can't be copied)."""

    group: dist.ProcessGroup | None
    SHARD_DIMS: dict[str, int]
    transposed = False  # an HF Conv1D's weight, stored (in, out): forward uses its transpose

    def __deepcopy__(self, memo: dict[int, Any]) -> _Sharded:
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class ColwiseLinear(_Sharded):
    """``nn.Linear`` with its output features split over the group: the output is sharded on the last dim.

    ``blocks > 1``: the output packs that many blocks (a fused q, k, v: 3), each
    split on its own, so this rank's output is ``[q_r | k_r | v_r]`` and
    ``forward``'s ``chunk(3, dim=-1)`` still finds q, k and v.
    """

    SHARD_DIMS = {"weight": 0, "bias": 0}

    def __init__(
        self,
        full: nn.Linear,
        group: dist.ProcessGroup | None,
        name: str = "colwise",
        blocks: int = 1,
        shard: Any = None,
        sequence: bool = False,
    ):
        super().__init__()
        _expect(full, nn.Linear, "colwise", name)
        self.group, self.blocks = group, blocks
        self.sequence = sequence  # the input is this rank's slice of the sequence: all-gathered
        self.in_features, out_features, self.transposed = _linear_sizes(full)
        if out_features % blocks:
            raise ValueError(f"{name}.out_features = {out_features} is not {blocks} equal blocks")
        what = f"{name}.out_features / {blocks} blocks" if blocks > 1 else f"{name}.out_features"
        self.out_features = blocks * _shard_size(out_features // blocks, group, what)
        out_dim = 1 if self.transposed else 0  # an HF Conv1D keeps its (in, out / T) layout
        if self.transposed:
            self.SHARD_DIMS = {"weight": 1, "bias": 0}
        self.weight = _shard(
            full.weight, out_dim, group, blocks, f"{name}.weight", shard
        )  # (out / T, in)
        self.bias = _shard(full.bias, 0, group, blocks, f"{name}.bias", shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        if self.sequence:
            return colwise_from_sequence(x, weight, self.bias, self.group)
        return colwise_linear(x, weight, self.bias, self.group)

    def extra_repr(self) -> str:
        full = self.out_features * group_size(self.group)
        packed = f" in {self.blocks} blocks" if self.blocks > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features} (shard of {full}{packed})"


class RowwiseLinear(_Sharded):
    """``nn.Linear`` with its input features split over the group: partial outputs are all-reduced.

    The input may be sharded on the last dim already (from a colwise layer: no
    communication) or full (this rank takes its slice).
    """

    SHARD_DIMS = {"weight": 1}  # the bias is replicated and added once, after the reduction

    def __init__(
        self,
        full: nn.Linear,
        group: dist.ProcessGroup | None,
        name: str = "rowwise",
        shard: Any = None,
        sequence: bool = False,
    ):
        super().__init__()
        _expect(full, nn.Linear, "rowwise", name)
        self.group, self.name = group, name
        self.sequence = (
            sequence  # the output is this rank's slice of the sequence: reduce-scattered
        )
        in_features, self.out_features, self.transposed = _linear_sizes(full)
        self.in_features = _shard_size(in_features, group, f"{name}.in_features")
        in_dim = 0 if self.transposed else 1  # an HF Conv1D keeps its (in / T, out) layout
        if self.transposed:
            self.SHARD_DIMS = {"weight": 0}
        self.weight = _shard(
            full.weight, in_dim, group, 1, f"{name}.weight", shard
        )  # (out, in / T)
        self.bias = (
            None
            if full.bias is None
            else nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # a full input: keep my slice
            x = scatter_last_dim(x, self.group)
        weight = self.weight.t() if self.transposed else self.weight
        if not self.sequence:
            return rowwise_linear(x, weight, self.group, bias=self.bias)
        return rowwise_to_sequence(x, weight, self.bias, self.group, self.name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (shard of {self.in_features * group_size(self.group)}), out_features={self.out_features}"


class VocabEmbedding(_Sharded):
    """``nn.Embedding`` split over the vocabulary: each rank looks up its rows, others give zeros, then all-reduce."""

    SHARD_DIMS = {"weight": 0}

    def __init__(
        self,
        full: nn.Embedding,
        group: dist.ProcessGroup | None,
        name: str = "vocab",
        shard: Any = None,
    ):
        super().__init__()
        _expect(full, nn.Embedding, "vocab", name)
        if full.max_norm is not None or full.scale_grad_by_freq or full.sparse:
            raise ValueError(
                f"{name}: vocab supports nn.Embedding(num_embeddings, embedding_dim[, padding_idx]);"
                " max_norm, scale_grad_by_freq and sparse are not supported"
            )
        self.group = group
        self.embedding_dim = full.embedding_dim
        self.num_embeddings = _shard_size(full.num_embeddings, group, f"{name}.num_embeddings")
        self.start = group_rank(group) * self.num_embeddings  # first token id of my rows
        self.padding_idx = full.padding_idx
        self.weight = _shard(full.weight, 0, group, 1, f"{name}.weight", shard)  # (vocab / T, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight, self.padding_idx)
        return vocab_lookup(ids, self.weight, self.start, self.padding_idx, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} of {self.num_embeddings * group_size(self.group)} rows from {self.start}, {self.embedding_dim}"


def vocab_lookup(
    ids: torch.Tensor,
    weight: torch.Tensor,
    start: int,
    padding_idx: int | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Embedding rows ``start..start + len(weight)`` of the vocabulary: other ranks' tokens give
    zeros, then the partial lookups are summed over the group (each token found on one rank)."""
    rows = weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)  # another rank's tokens
    pad = padding_idx - start if padding_idx is not None else None
    pad = pad if pad is not None and 0 <= pad < rows else None
    out = F.embedding(local.masked_fill(outside, 0), weight, pad)
    return reduce_from_tensor_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), group)


def local_count(value: Any, group: dist.ProcessGroup | None, what: str) -> int:
    """An int attribute (heads, features) divided by the tensor-parallel size: the local count."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"divide needs an int attribute, but {what} is {type(value).__name__}")
    return _shard_size(value, group, what)


def _expect(layer: nn.Module, kind: type, style: str, name: str) -> None:
    if kind is nn.Linear and is_conv1d(layer):
        return
    if not isinstance(layer, kind):  # subclasses too (torchtitan's Linear)
        raise TypeError(
            f"{name}: {style} needs an nn.{kind.__name__} (or a subclass), not {type(layer).__name__}"
            " (colwise/rowwise: nn.Linear, vocab: nn.Embedding, divide: an int attribute)"
        )


# -- checkpoints --------------------------------------------------------------------


SHARDED = (ColwiseLinear, RowwiseLinear, VocabEmbedding)


def _sharded_keys(
    module: nn.Module,
) -> Iterator[tuple[str, int, int, dist.ProcessGroup | None]]:
    """(state-dict key, shard dim, packed blocks, group) of every sharded parameter, in module order."""
    for name, sub in module.named_modules():
        if isinstance(sub, SHARDED):
            for param, dim in sub.SHARD_DIMS.items():
                if getattr(sub, param) is not None:
                    key = f"{name}.{param}" if name else param
                    yield key, dim, getattr(sub, "blocks", 1), sub.group


def _gather(
    t: torch.Tensor, dim: int, blocks: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    if group_size(group) == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return join(parts, dim, blocks)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state dict (same keys, same shapes), gathered on every rank."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for key, dim, blocks, group in _sharded_keys(module):
        state[key] = _gather(state[key], dim, blocks, group)
    return state


def full_gradients(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient at full (serial) shape, by parameter name, gathered on every rank."""
    grads = {k: p.grad for k, p in module.named_parameters()}
    for key, dim, blocks, group in _sharded_keys(module):
        grad = grads.get(key)
        if grad is not None:
            grads[key] = _gather(grad, dim, blocks, group)
    return {k: (None if g is None else g.detach().clone()) for k, g in grads.items()}


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """Load a serial model's state dict: every rank keeps its shard of each sharded parameter."""
    local = dict(state_dict)
    for key, dim, blocks, group in _sharded_keys(module):
        if key in local:
            local[key] = split(local[key], dim, group, blocks)
    return module.load_state_dict(local, strict=strict)


def serial_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``full_state_dict`` under the name generated code calls (a method calling a function
    of the same name would read as recursion)."""
    return full_state_dict(module)


def load_serial_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """``load_full_state_dict`` under the name generated code calls."""
    return load_full_state_dict(module, state_dict, strict)


def num_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """The serial model's parameter count: each shard counts as the full tensor it is part of.

    ``sum(p.numel() for p in model.parameters())`` counts this rank's shards;
    use this where the serial figure is wanted (nanoGPT's ``get_num_params``,
    MFU estimates). Tied parameters count once, as ``parameters()`` does.
    """
    factor = {id(getattr(sub, param)): group_size(sub.group)
              for _, sub in module.named_modules() if isinstance(sub, SHARDED)
              for param in sub.SHARD_DIMS if getattr(sub, param) is not None}  # fmt: skip
    return sum(
        p.numel() * factor.get(id(p), 1)
        for p in module.parameters()
        if p.requires_grad or not trainable_only
    )
