"""Sequence parallelism's collectives (Megatron-SP, torch's ``SequenceParallel``).

Between tensor-parallel blocks (layer norms, dropout, residual adds) each rank
holds its slice of the sequence, dim 1 of (B, T, C): (B, T / tp, C), so the
activations saved there are 1 / tp of the serial ones. A rowwise layer "to
sequence" reduce-scatters its partial outputs along T (instead of all-reducing
them); a colwise layer "from sequence" all-gathers its input along T first and
reduce-scatters its input gradient (instead of all-reducing it).

    gather_sequence        forward: all-gather along T   backward: keep my slice
    scatter_sequence       forward: keep my slice        backward: all-gather along T
    colwise_from_sequence  F.linear(gather_sequence(x), W, b), grad x reduce-scattered
    rowwise_to_sequence    reduce_scatter_T(F.linear(x, W)) + b
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from macrogen.runtime.collectives import group_size
from macrogen.runtime.collectives_linear import (
    autocast_backward,
    autocast_forward,
    weight_bias_grads,
)

SEQUENCE_DIM = 1


def _check_sequence(length: int, size: int, what: str) -> None:
    if length % size:
        raise ValueError(
            f"{what}: the sequence length (dim {SEQUENCE_DIM}) {length} is not divisible by"
            f" the tensor-parallel size {size}; pad the sequence or choose a size that divides it"
        )


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T / tp, ...) on each rank -> (B, T, ...), ranks' slices in order, contiguous."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    blocks = x.new_empty((size * x.shape[0], *x.shape[1:]))  # rank r's slice is block r
    dist.all_gather_single(blocks, x, group=group)
    # (tp, B, T / tp, ...) -> (B, T, ...): one copy, to the layout the next layer reads
    return (
        blocks.view(size, *x.shape)
        .movedim(0, SEQUENCE_DIM)
        .reshape(x.shape[0], size * x.shape[1], *x.shape[2:])
    )


# Backends whose reduce-scatter along T is done as an all-reduce, keeping this rank's slice.
REDUCE_SCATTER_BY_ALL_REDUCE = {"gloo"}


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T / tp, ...) of their sum.

    ``x`` is a fresh result of the caller's (no one else holds it): gloo reduces it in place.
    """
    size = dist.get_world_size(group)
    _check_sequence(x.shape[SEQUENCE_DIM], size, what)
    B, T = x.shape[0], x.shape[1]
    if dist.get_backend(group) in REDUCE_SCATTER_BY_ALL_REDUCE:
        # gloo's reduce-scatter costs more than its all-reduce of the same input (measured:
        # 0.72-0.80 vs 0.52-0.56 ms of CPU for 512 KiB on 2 ranks), and the all-reduce needs
        # no copy to a rank-major layout first: all-reduce, keep my slice
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return _my_sequence_slice(x, group).contiguous()
    blocks = (
        x.reshape(B, size, T // size, *x.shape[2:]).movedim(1, 0).contiguous()
    )  # (tp, B, T / tp, ...)
    out = x.new_empty(blocks.shape[1:])  # contiguous (B, T / tp, ...)
    dist.reduce_scatter_single(out, blocks.flatten(0, 1), group=group)
    return out


def _my_sequence_slice(
    x: torch.Tensor, group: dist.ProcessGroup, what: str = "gather_sequence's gradient"
) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_sequence(x.shape[SEQUENCE_DIM], size, what)
    return x.chunk(size, dim=SEQUENCE_DIM)[rank]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(  # every consumer's gradient is whole (a colwise's f summed it)
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return _my_sequence_slice(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from every rank's slice (dim 1); backward keeps my slice."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group)  # type: ignore[no-untyped-call]


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _my_sequence_slice(x, group, "a sequence_parallel module's input").contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_sequence(grad, ctx.group), None


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of a whole sequence (dim 1); backward all-gathers the slices' gradients."""
    return x if group_size(group) == 1 else _ScatterSequence.apply(x, group)  # type: ignore[no-untyped-call]


class _ColwiseFromSequence(torch.autograd.Function):
    """F.linear(all_gather_T(x), W, b): backward reduce-scatters grad x along T."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        full = _all_gather_sequence(x, group)  # (B, T, in)
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    @autocast_backward
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        full, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # partial sums over my output features, for every token
            grad_x = _reduce_scatter_sequence(grad.matmul(weight), ctx.group, "colwise")
        grad_w, grad_b = weight_bias_grads(ctx, grad, full)
        return grad_x, grad_w, grad_b, None


class _RowwiseToSequence(torch.autograd.Function):
    """reduce_scatter_T(F.linear(x, W)) + b: backward all-gathers the output gradient along T
    (so the bias gradient, a sum over every token, needs no collective)."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        what: str,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        out = _reduce_scatter_sequence(F.linear(x, weight), group, what)
        return out if bias is None else out.add_(bias)

    @staticmethod
    @autocast_backward
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        grad = _all_gather_sequence(grad, ctx.group)  # (B, T, out)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = weight_bias_grads(ctx, grad, x)
        return grad_x, grad_w, grad_b, None, None


def colwise_from_sequence(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """F.linear(gather_sequence(x), weight, bias), the gradient of x reduce-scattered along T."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return cast(torch.Tensor, _ColwiseFromSequence.apply(x, weight, bias, group))  # type: ignore[no-untyped-call]


def rowwise_to_sequence(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    what: str = "rowwise",
) -> torch.Tensor:
    """This rank's sequence slice of the sum over ranks of F.linear(x, weight), plus bias."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return cast(torch.Tensor, _RowwiseToSequence.apply(x, weight, bias, group, what))  # type: ignore[no-untyped-call]
