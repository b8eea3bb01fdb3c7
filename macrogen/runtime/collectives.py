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

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

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


# -- linear layers with their collective fused in -----------------------------------------
#
# Same results as F.linear(f(x), W, b) and g(F.linear(x, W)) in one autograd node
# each, reducing in place (no copies). With overlap, the collective runs while
# the next matmul computes (Megatron's async gradient all-reduce, and a chunked
# forward reduction), hiding the communication behind compute.

# False: each collective runs alone, in order (simpler to profile; on a machine
# with no core to spare for gloo's threads, overlap gains little: bench/tp.py).
OVERLAP = True


# Under torch.autocast the backward runs with the forward's autocast state, as F.linear's does.
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _autocast_forward(forward: _Fn) -> _Fn:
    return cast(_Fn, torch.amp.custom_fwd(forward, device_type="cuda"))


def _autocast_backward(backward: _Fn) -> _Fn:
    """``torch.amp.custom_bwd(device_type="cuda")``, entering no autocast context where neither
    the forward nor the caller had autocast on (the usual case; the context costs ~20 us a call)."""
    with_autocast = torch.amp.custom_bwd(backward, device_type="cuda")

    @functools.wraps(backward)
    def run(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx._fwd_used_autocast or torch.is_autocast_enabled("cuda"):
            return with_autocast(ctx, *grads)
        return backward(ctx, *grads)

    return cast(_Fn, run)


class _ColwiseLinear(torch.autograd.Function):
    """F.linear(f(x), W, b): backward all-reduces grad x (overlapping grad W and grad b)."""

    @staticmethod
    @_autocast_forward
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
    @_autocast_backward
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
        grad2d = grad.reshape(-1, grad.shape[-1])  # (N, out / T)
        grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:  # None: it ran synchronously
            work.wait()
        return grad_x, grad_w, grad_b, None


class _RowwiseLinear(torch.autograd.Function):
    """g(F.linear(x, W)) + b: forward all-reduces the output (each chunk of rows while the next
    computes), then adds the bias in place (no second output-sized tensor)."""

    @staticmethod
    @_autocast_forward
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
    @_autocast_backward
    def backward(  # g's backward is the identity: only the linear's remains
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
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


# -- sequence parallelism (Megatron-SP, torch's SequenceParallel) ------------------------------
#
# Between tensor-parallel blocks (layer norms, dropout, residual adds) each rank
# holds its slice of the sequence, dim 1 of (B, T, C): (B, T / tp, C), so the
# activations saved there are 1 / tp of the serial ones. A rowwise layer "to
# sequence" reduce-scatters its partial outputs along T (instead of all-reducing
# them); a colwise layer "from sequence" all-gathers its input along T first and
# reduce-scatters its input gradient (instead of all-reducing it).

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
    @_autocast_forward
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
    @_autocast_backward
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        full, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # partial sums over my output features, for every token
            grad_x = _reduce_scatter_sequence(grad.matmul(weight), ctx.group, "colwise")
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_w = (
            grad2d.t().mm(full.reshape(-1, full.shape[-1])) if ctx.needs_input_grad[1] else None
        )
        grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class _RowwiseToSequence(torch.autograd.Function):
    """reduce_scatter_T(F.linear(x, W)) + b: backward all-gathers the output gradient along T
    (so the bias gradient, a sum over every token, needs no collective)."""

    @staticmethod
    @_autocast_forward
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
    @_autocast_backward
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        grad = _all_gather_sequence(grad, ctx.group)  # (B, T, out)
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
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
