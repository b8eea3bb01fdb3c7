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
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f: identity forward; backward sums the input gradient over the group."""
    return x if group_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g: forward sums the partial results over the group; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterLastDim.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's slice, concatenated along the last dimension; backward keeps my slice."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)
