"""Tensor-parallel collectives as autograd functions (Megatron's f and g, and their kin).

Plain tensors in, plain tensors out: each function says what it does forward
and what its backward does, so a reader of generated code can follow every
collective. ``group=None`` means "not distributed": every function is then the
identity (a serial run, or a tensor-parallel degree of 1).

    f = copy_to_tensor_parallel      forward: identity       backward: all-reduce
    g = reduce_from_tensor_parallel  forward: all-reduce     backward: identity
    scatter_last_dim                 forward: keep my slice  backward: all-gather
    gather_last_dim                  forward: all-gather     backward: keep my slice

A colwise layer is entered through ``f`` (its input is replicated, so the
gradient of that input is the sum over ranks); a rowwise layer leaves through
``g`` (each rank holds a partial sum). Between colwise and rowwise nothing is
communicated.

The same with a linear layer fused in, its collective overlapping compute:
``collectives_linear``; sequence parallelism's: ``collectives_sequence``.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from macrogen.runtime.eager import eager


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd saved
    dist.all_reduce(x, group=group)
    return x


def _all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[-1] % size:
        raise ValueError(
            f"the last dimension ({x.shape[-1]}) is not divisible by the tensor-parallel size {size}"
        )
    return x.chunk(size, dim=-1)[rank].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last_dim(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_slice_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f: identity forward; backward sums the input gradient over the group."""
    return x if group_size(group) == 1 else _CopyToTensorParallel.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g: forward sums the partial results over the group; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)  # type: ignore[no-untyped-call]


def scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterLastDim.apply(x, group)  # type: ignore[no-untyped-call]


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's slice, concatenated along the last dimension; backward keeps my slice."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)  # type: ignore[no-untyped-call]


class _CountedOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        return x.view_as(x) if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def counted_once(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` on the group's first rank, zeros on the others; backward: the identity on every rank.

    A replicated bias added inside a layer whose output is then summed over the group (a
    rowwise layer running its own forward): the sum counts it once, and each rank's copy gets
    the whole gradient (the output's gradient is the same on every rank), as serially.
    """
    if group_size(group) == 1:
        return x
    return cast(torch.Tensor, _CountedOnce.apply(x, group_rank(group) == 0))  # type: ignore[no-untyped-call]


# -- vocabulary-parallel cross-entropy -------------------------------------------------------
#
# The logits of a colwise (vocabulary-sharded) head stay sharded: each rank holds
# (N, V / T). The loss needs, per row, log(sum_v exp(z_v)) and z_target; both are sums
# over the vocabulary, so each rank sums its part and one all-reduce adds them (after
# one all-reduce of the row maxima, for a stable exp). Logit memory stays V / T per rank.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        ignore_index: int,
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        start = dist.get_rank(group) * n_local  # first vocabulary id of my columns
        z = logits.to(_loss_dtype(logits.dtype))  # fp16/bf16 in fp32; fp32, fp64 as they are
        row_max = z.detach().amax(dim=-1)  # (N,)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max.unsqueeze(-1)  # (N, V / T)
        local = target - start
        mine = (local >= 0) & (local < n_local)  # targets in my columns
        picked = shifted.gather(-1, local.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), picked * mine])  # (2, N): partial sums over my columns
        dist.all_reduce(sums, group=group)
        loss = sums[0].log() - sums[1]  # (N,)
        valid = target != ignore_index
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, mine & valid, valid)
        ctx.dtype = logits.dtype
        return (loss * valid).to(logits.dtype)  # F.cross_entropy's loss has the logits' dtype

    @staticmethod
    def backward(  # d loss_i / d z_iv = softmax_iv - [v == target_i]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, hit, valid = ctx.saved_tensors
        grad = grad.to(softmax.dtype)
        g = softmax * (grad * valid).unsqueeze(-1)
        # minus grad at each row's target where it is one of my columns (0 elsewhere): a
        # scatter, not an index by hit.nonzero(), whose data-dependent shape breaks a graph
        n_local = g.shape[-1]
        g.scatter_add_(-1, local.clamp(0, n_local - 1).unsqueeze(-1), (-grad * hit).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` from this rank's vocabulary slice of the logits.

    ``logits``: (N, V / T), rank r holding columns [r V/T, (r+1) V/T) (a colwise
    head's output), or the DTensor ``as_sharded_dtensor`` made of it; ``target``: (N,)
    global ids. Without a group: F.cross_entropy. Computed in the logits' dtype (fp32
    for fp16/bf16); the loss has their dtype, as F.cross_entropy's.
    """
    if isinstance(logits, DTensor):  # forward also returns these logits: see as_sharded_dtensor
        logits = logits.to_local()
    if group_size(group) == 1:
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if logits.dim() != 2 or reduction not in ("mean", "sum", "none"):
        raise ValueError(
            "vocab-parallel cross-entropy takes (N, V) logits and (N,) targets with reduction"
            f" 'mean', 'sum' or 'none'; got logits of shape {tuple(logits.shape)}, {reduction!r}"
        )
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)  # type: ignore[no-untyped-call]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def as_sharded_dtensor(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``, this rank's slice of the last dim, as a DTensor sharded there (no communication).

    What a colwise head returns when forward also feeds it to the vocab-parallel loss
    (torch's ``loss_parallel`` logits): the loss takes the local part; any other use
    sees the serial tensor (``.full_tensor()``) or fails loudly, never a slice.
    """
    if group_size(group) == 1:
        return x
    return DTensor.from_local(x, _mesh(group, x.device.type), [Shard(x.dim() - 1)], run_check=False)


@eager  # built once, outside any traced region (dynamo can't build one)
@functools.lru_cache(maxsize=8)
def _mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)
