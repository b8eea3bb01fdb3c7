"""Each planned module runs its own ``forward`` (its class's, a subclass's override included) on
its local shards, with its style's collectives around it, as torch's ``ParallelStyle``s do:

    style                  before the module's forward              after it
    colwise                input copied to the group (f)            the output is this rank's slice
    colwise_gather_output  the same                                 the slices gathered
    rowwise                a whole input split (keep my slice)      partial sums all-reduced (g);
                                                                    the bias counted on one rank
    vocab                  ids offset into my rows, others masked   other ranks' rows zeroed, g
    embedding_colwise      -                                        the columns gathered
    all_reduce             every float input f                      g
    moe_experts            the same (whole experts per rank: the    g
                           routes to other ranks' experts masked)
    moe_identity_expert    the input on one rank, zeros on others   -
    mla_kv_a_proj          -                                        f on the rope part
    sequence_parallel      a whole sequence split (dim 1)           the slices gathered

(f: identity forward, all-reduce backward; g: all-reduce forward, identity backward.)

A layer whose class's forward is ``nn.Linear``'s, HF ``Conv1D``'s or ``nn.Embedding``'s
(``F.linear`` / ``F.embedding`` of its parameters) takes the fused layer of
``macrogen.runtime.collectives_linear``, which computes the same thing with its collective
overlapped; any other forward runs as written (and is checked against the serial layer when
the plan is applied: ``checks.probe``). The wrapper is an instance attribute: the class is
untouched.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from macrogen.runtime.collectives import (
    copy_to_tensor_parallel,
    counted_once,
    gather_last_dim,
    reduce_from_tensor_parallel,
    scatter_last_dim,
)
from macrogen.runtime.collectives_linear import colwise_linear, rowwise_linear
from macrogen.runtime.collectives_sequence import gather_sequence, scatter_sequence
from macrogen.runtime.parallelize.layout import Wrap
from macrogen.runtime.parallelize.local import local_parameters, weakly_bound
from macrogen.runtime.parallelize.plan import Style
from macrogen.runtime.parallelize.sequence import FORWARDS as SEQUENCE_FORWARDS

LAST_OUTPUT = "_mg_last_output"  # a colwise layer's last output (weakly): may the model return it?


@dataclass(frozen=True)
class Wrapped:
    """What a wrapped forward needs: the module's own forward and its group."""

    own: Callable[..., Any]  # own(module, *args, **kwargs)
    group: dist.ProcessGroup
    rank: int
    size: int
    style: Style
    kind: str | None  # plan.layer_kind
    fast: bool  # F.linear / F.embedding of its parameters: the fused layer computes it
    width: int  # rowwise: the whole input width; vocab: this rank's rows; moe: all experts
    name: str = ""  # its path in the model (for errors)


def install(wrap: Wrap, group: dist.ProcessGroup) -> None:
    """``wrap.module``'s forward, wrapped (an instance attribute around its own)."""
    module, style = wrap.module, wrap.style
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    width = wrap.experts  # (the weights are DTensors already: their shapes are the serial ones)
    if style.kind in ("rowwise", "rowwise_to_sequence"):
        weight: Any = module.weight
        width = int(weight.shape[1] if wrap.kind == "linear" else weight.shape[0])
    elif style.kind == "vocab":
        width = int(module.weight.shape[0]) // size  # type: ignore[index]
    spec = Wrapped(_own(module), group, rank, size, style, wrap.kind, is_fast(module, wrap.kind),
                   width, wrap.name)  # fmt: skip
    forward = FORWARDS[style.kind]
    module.__dict__["forward"] = weakly_bound(forward, module, spec)


def _style_of(module: nn.Module) -> tuple[Any, Wrapped | None]:
    """The module's style wrapper (its instance forward) and what it wraps; None: no style."""
    bound: Any = module.__dict__.get("forward")
    spec = next(iter(getattr(bound, "args", ())), None)
    return bound, spec if isinstance(spec, Wrapped) else None


def wrap_inside(
    module: nn.Module, inner: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> bool:
    """``module``'s style wrapper calls ``inner(own)`` where it called the module's own forward
    ``own``, its collectives staying around it (expert parallelism routes inside a
    tensor-parallel experts module). False: no style wraps ``module``."""
    bound, spec = _style_of(module)
    if spec is None:
        return False
    module.__dict__["forward"] = weakly_bound(bound.fn, module, replace(spec, own=inner(spec.own)))
    return True


@contextlib.contextmanager
def unstyled(module: nn.Module) -> Iterator[None]:
    """``module`` called runs its own forward, without its style's collectives (a serial probe
    of the layer on whole tensors); as it is when no style wraps it."""
    bound, spec = _style_of(module)
    if spec is None:
        yield
        return
    module.__dict__["forward"] = functools.partial(spec.own, module)
    try:
        yield
    finally:
        module.__dict__["forward"] = bound


def _own(module: nn.Module) -> Callable[..., Any]:
    """The module's own forward as ``own(module, *args, **kwargs)``: an instance forward already
    there (another wrapper's), else its class's."""
    bound = module.__dict__.get("forward")
    if bound is None:
        return type(module).forward

    def call(_: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)

    return call


def is_fast(module: nn.Module, kind: str | None) -> bool:
    """The module's forward is ``F.linear`` / ``F.embedding`` of its parameters (its class's
    forward is nn.Linear's, HF Conv1D's or nn.Embedding's), so the fused layer computes it."""
    if "forward" in module.__dict__:
        return False
    forward = type(module).forward
    if kind == "linear":
        return forward is nn.Linear.forward
    if kind == "embedding":
        return forward is nn.Embedding.forward
    if kind == "conv1d":
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError:
            return False
        return forward is Conv1D.forward
    return False


def _local(t: Any) -> Any:
    """A planned layer called outside its model's forward still holds DTensors."""
    return t.to_local() if isinstance(t, DTensor) else t


def _weight(module: nn.Module, kind: str | None) -> torch.Tensor:
    w = _local(module.weight)
    return w.t() if kind == "conv1d" else w  # type: ignore[no-any-return]  # F.linear's (out, in)


# -- the styles --------------------------------------------------------------------------------


def _colwise(me: nn.Module, s: Wrapped, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if s.fast:  # the fused layer: f's backward all-reduce overlaps the weight gradient
        out = colwise_linear(x, _weight(me, s.kind), _local(me.bias), s.group)
    else:
        with local_parameters(me):
            out = s.own(me, copy_to_tensor_parallel(x, s.group), *args, **kwargs)
    if s.style.kind == "colwise_gather_output":
        return gather_last_dim(out, s.group)
    if not torch.compiler.is_compiling():  # (an eager run checks it: no weakref of a traced value)
        me.__dict__[LAST_OUTPUT] = weakref.ref(out)
    return out


def _rowwise(me: nn.Module, s: Wrapped, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if x.shape[-1] == s.width:  # a whole input: keep my slice
        x = scatter_last_dim(x, s.group)
    if s.fast:  # the fused layer: the bias added once, after the reduction
        return rowwise_linear(x, _weight(me, s.kind), s.group, bias=_local(me.bias))
    with local_parameters(me), _bias_once(me, s.group):
        out = s.own(me, x, *args, **kwargs)
    return reduce_from_tensor_parallel(out, s.group)


@contextlib.contextmanager
def _bias_once(module: nn.Module, group: dist.ProcessGroup) -> Iterator[None]:
    """The layer's own forward adds its (whole) bias on every rank: count it on one."""
    bias = module._parameters.get("bias")
    if bias is None:
        yield
        return
    module._parameters["bias"] = counted_once(bias, group)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._parameters["bias"] = bias


def _vocab(me: nn.Module, s: Wrapped, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    start = s.rank * s.width
    local = ids - start
    outside = (local < 0) | (local >= s.width)  # another rank's rows
    local = local.masked_fill(outside, 0)
    if s.fast:
        assert isinstance(me, nn.Embedding)
        out = F.embedding(local, _local(me.weight), _local_padding(me, start, s.width))
    else:
        with local_parameters(me), _padding(me, start, s.width):
            out = s.own(me, local, *args, **kwargs)
    return reduce_from_tensor_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), s.group)


def _local_padding(module: nn.Module, start: int, rows: int) -> int | None:
    pad = getattr(module, "padding_idx", None)
    return pad - start if pad is not None and 0 <= pad - start < rows else None


@contextlib.contextmanager
def _padding(module: nn.Module, start: int, rows: int) -> Iterator[None]:
    """The padding row as an index into this rank's rows (None: another rank's) while the
    module's own forward looks up local ids."""
    pad = getattr(module, "padding_idx", None)
    if pad is None:
        yield
        return
    object.__setattr__(module, "padding_idx", _local_padding(module, start, rows))
    try:
        yield
    finally:
        object.__setattr__(module, "padding_idx", pad)


def _embedding_colwise(me: nn.Module, s: Wrapped, *args: Any, **kwargs: Any) -> Any:
    with local_parameters(me):
        out = s.own(me, *args, **kwargs)
    return gather_last_dim(out, s.group)


def _partial_sum(me: nn.Module, s: Wrapped, *args: Any, **kwargs: Any) -> Any:
    """all_reduce, moe_experts: each rank computes a partial sum of the output from replicated
    inputs, so the inputs' gradients are partial too (f) and the output is summed (g)."""
    args = tuple(_copied(a, s.group) for a in args)
    kwargs = {k: _copied(v, s.group) for k, v in kwargs.items()}
    if s.width and s.style.kind == "moe_experts":  # whole experts per rank: other routes masked
        args, kwargs = _route(s, args, kwargs)
    with local_parameters(me):
        out = s.own(me, *args, **kwargs)
    if isinstance(out, torch.Tensor):
        return reduce_from_tensor_parallel(out, s.group)
    raise TypeError(
        f"{type(me).__name__} planned {s.style.kind} returns {type(out).__name__}, not a tensor"
    )


def _copied(value: Any, group: dist.ProcessGroup) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return copy_to_tensor_parallel(value, group)
    return value


def _route(s: Wrapped, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(hidden_states, top_k_index, top_k_weights) with global expert ids -> this rank's: ids of
    other ranks' experts become the sentinel ``local`` (skipped) and their weights 0."""
    values = list(args) + [None] * (3 - len(args))
    for i, name in ((1, "top_k_index"), (2, "top_k_weights")):
        if name in kwargs:
            values[i] = kwargs.pop(name)
    index, weights = values[1], values[2]
    if index is None or weights is None:
        raise TypeError("moe_experts over whole experts takes (hidden, top_k_index, top_k_weights)")
    local = s.width // s.size
    elsewhere = torch.div(index, local, rounding_mode="floor") != s.rank
    values[1] = torch.where(elsewhere, local, index - s.rank * local)
    values[2] = weights.masked_fill(elsewhere, 0.0)
    return tuple(values[: max(3, len(args))]), kwargs


def _identity_expert(me: nn.Module, s: Wrapped, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Inside moe_experts, whose output is summed over the group: the identity counted once."""
    return s.own(me, x if s.rank == 0 else torch.zeros_like(x), *args, **kwargs)


def _mla_kv_a_proj(me: nn.Module, s: Wrapped, *args: Any, **kwargs: Any) -> Any:
    """MLA's kv_a projection (whole on every rank): its output's rope part goes to attention on
    this rank's heads only, so its gradient is partial (f); the rest reaches a colwise layer,
    whose f sums it already."""
    with local_parameters(me):
        out = s.own(me, *args, **kwargs)
    keep, rope = out.split([out.shape[-1] - s.style.size, s.style.size], dim=-1)
    return torch.cat([keep, copy_to_tensor_parallel(rope, s.group)], dim=-1)


def _sequence(me: nn.Module, s: Wrapped, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A per-token module on this rank's slice of the sequence (its parameters' gradients are
    summed by the local forward: they see this rank's tokens only), gathered after."""
    with local_parameters(me):
        out = s.own(me, scatter_sequence(x, s.group), *args, **kwargs)
    return gather_sequence(out, s.group)


FORWARDS: dict[str, Callable[..., Any]] = {
    "colwise": _colwise,
    "colwise_gather_output": _colwise,
    "rowwise": _rowwise,
    "vocab": _vocab,
    "embedding_colwise": _embedding_colwise,
    "all_reduce": _partial_sum,
    "moe_experts": _partial_sum,
    "moe_identity_expert": _identity_expert,
    "mla_kv_a_proj": _mla_kv_a_proj,
    "sequence_parallel": _sequence,
    **SEQUENCE_FORWARDS,
}
