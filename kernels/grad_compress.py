"""Gradient compression for data-parallel all-reduce: fp32 -> scaled bf16/fp16 -> fp32.

    compress(grads, comm, scale)   # comm = (grads * scale).to(comm.dtype)
    decompress(comm, grads)        # grads = comm.to(grads.dtype)

Both take flat contiguous tensors of the same length. On CUDA tensors each is
one Triton kernel (one pass over memory, no temporaries); elsewhere a torch
path does the same in one vectorized op. Under ``TRITON_INTERPRET=1`` the
Triton path also runs on CPU tensors (that is how the kernels are tested).
"""

from __future__ import annotations

import torch

from macrogen.runtime.triton_support import HAS_TRITON, interpreting, tl, triton, use_triton

BLOCK = 1024  # elements per program: a few KiB per load, enough to hide latency

COMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@triton.jit
def _compress_kernel(
    grads_ptr,  # fp32 (or any float) input
    comm_ptr,  # bf16/fp16 output
    n,  # elements
    scale,  # 1 / world size: the average is taken before the sum, so fp16 can't overflow
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grads_ptr + offs, mask=mask).to(tl.float32)
    tl.store(comm_ptr + offs, (g * scale).to(comm_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decompress_kernel(
    comm_ptr,  # bf16/fp16 input, all-reduced
    grads_ptr,  # fp32 output: the gradients the optimizer reads
    n,  # elements
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(comm_ptr + offs, mask=mask)
    tl.store(grads_ptr + offs, c.to(grads_ptr.dtype.element_ty), mask=mask)


def _triton_path(*tensors: torch.Tensor) -> bool:
    device = tensors[0].device
    return HAS_TRITON and (use_triton(device) or (interpreting() and device.type == "cpu"))


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
        raise ValueError(
            f"expected two flat tensors of one length, got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("compress/decompress need contiguous buffers")


def compress(grads: torch.Tensor, comm: torch.Tensor, scale: float) -> None:
    """``comm[:] = grads * scale`` rounded to ``comm``'s half-precision dtype."""
    _check(grads, comm)
    n = grads.numel()
    if n == 0:
        return
    if _triton_path(grads, comm):
        grid = (triton.cdiv(n, BLOCK),)
        _compress_kernel[grid](grads, comm, n, scale, BLOCK=BLOCK)
    else:
        torch.mul(grads, scale, out=comm)


def decompress(comm: torch.Tensor, grads: torch.Tensor) -> None:
    """``grads[:] = comm`` widened back to ``grads``' dtype."""
    _check(comm, grads)
    n = comm.numel()
    if n == 0:
        return
    if _triton_path(comm, grads):
        grid = (triton.cdiv(n, BLOCK),)
        _decompress_kernel[grid](comm, grads, n, BLOCK=BLOCK)
    else:
        grads.copy_(comm)
