"""Tensor-parallel linear layers with their collective fused in (``collectives`` has the plain ones).

Same results as ``F.linear(f(x), W, b)`` and ``g(F.linear(x, W))`` in one autograd node
each, reducing in place (no copies). With overlap, the collective runs while the next
matmul computes (Megatron's async gradient all-reduce, and a chunked forward reduction),
hiding the communication behind compute.

    colwise_linear   F.linear(f(x), W, b)  backward: all-reduce of grad x beside grad W
    rowwise_linear   g(F.linear(x, W)) + b  forward: row blocks reduced as they are computed
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from macrogen.runtime.collectives import group_size

# False: each collective runs alone, in order (simpler to profile; on a machine
# with no core to spare for gloo's threads, overlap gains little: bench/tp.py).
OVERLAP = True


# Under torch.autocast the backward runs with the forward's autocast state, as F.linear's does.
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def autocast_forward(forward: _Fn) -> _Fn:
    return cast(_Fn, torch.amp.custom_fwd(forward, device_type="cuda"))


def autocast_backward(backward: _Fn) -> _Fn:
    """``torch.amp.custom_bwd(device_type="cuda")``, entering no autocast context where neither
    the forward nor the caller had autocast on (the usual case; the context costs ~20 us a call)."""
    with_autocast = torch.amp.custom_bwd(backward, device_type="cuda")

    @functools.wraps(backward)
    def run(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx._fwd_used_autocast or torch.is_autocast_enabled("cuda"):
            return with_autocast(ctx, *grads)
        return backward(ctx, *grads)

    return cast(_Fn, run)


def weight_bias_grads(
    ctx: Any, grad: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``F.linear(x, W, b)``'s weight and bias from its output's gradient
    (None where autograd needs none): one per fused linear's backward."""
    grad2d = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_w, grad_b


class _ColwiseLinear(torch.autograd.Function):
    """F.linear(f(x), W, b): backward all-reduces grad x (overlapping grad W and grad b)."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @autocast_backward
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)  # (..., in): a partial sum on each rank
            # traced (AOTAutograd traces this backward too): synchronous, or dynamo breaks the graph
            overlap = OVERLAP and not torch.compiler.is_compiling()
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=overlap)
        grad_w, grad_b = weight_bias_grads(ctx, grad, x)  # (grad: (..., out / T))
        if work is not None:  # None: it ran synchronously
            work.wait()
        return grad_x, grad_w, grad_b, None


class _RowwiseLinear(torch.autograd.Function):
    """g(F.linear(x, W)) + b: forward all-reduces the output (each chunk of rows while the next
    computes), then adds the bias in place (no second output-sized tensor)."""

    @staticmethod
    @autocast_forward
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        chunks: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x2d = x.reshape(-1, x.shape[-1])  # (N, in / T)
        out = x2d.new_empty(x2d.shape[0], weight.shape[0])  # (N, out)
        if torch.compiler.is_compiling():
            # dynamo breaks the graph at an async collective: one synchronous all-reduce, which
            # it traces (and Inductor may overlap on its own)
            torch.mm(x2d, weight.t(), out=out)
            dist.all_reduce(out, group=group)
        else:
            works = []
            for xs, ys in zip(
                x2d.split(_rows(x2d.shape[0], chunks)), out.split(_rows(x2d.shape[0], chunks))
            ):
                torch.mm(xs, weight.t(), out=ys)
                works.append(dist.all_reduce(ys, group=group, async_op=True))
            for work in works:
                work.wait()
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @autocast_backward
    def backward(  # g's backward is the identity: only the linear's remains
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = weight_bias_grads(ctx, grad, x)
        return grad_x, grad_w, grad_b, None, None


def _rows(n: int, chunks: int) -> int:
    return max(1, -(-n // max(1, chunks)))


def colwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """F.linear(f(x), weight, bias); with overlap, f's backward all-reduce runs beside the weight gradient."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return cast(torch.Tensor, _ColwiseLinear.apply(x, weight, bias, group))  # type: ignore[no-untyped-call]


CHUNK_ELEMENTS = 1 << 20  # rowwise outputs at least this big are reduced in chunks (4 at most)


def rowwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None,
    chunks: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """g(F.linear(x, weight)) + bias (added once, after the reduction); with overlap, row
    blocks are reduced as they are computed.

    Small outputs go in one collective: below ``CHUNK_ELEMENTS`` a chunk's
    reduction is latency-bound and there is little matmul left to hide it behind.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    if chunks is None:
        big = math.prod(x.shape[:-1]) * weight.shape[0] // CHUNK_ELEMENTS
        chunks = max(1, min(4, big)) if OVERLAP else 1
    if chunks > 1:
        out: torch.Tensor = _RowwiseLinear.apply(x, weight, bias, group, chunks)  # type: ignore[no-untyped-call]
        return out
    # One reduction: no autograd Function. g's backward is the identity, so autograd's own
    # backward of the local linear (and of the bias add) is already the right one; the partial
    # output is summed in place outside autograd (nothing saved it). Same products as the
    # Function, without its Python forward and backward (~0.15 ms a layer a step, measured).
    out = F.linear(x, weight)
    dist.all_reduce(out.detach(), group=group)
    return out if bias is None else out.add_(bias)
