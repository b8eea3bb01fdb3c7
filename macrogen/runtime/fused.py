"""Fused all-reduce: K tensors, one flat buffer and one collective per dtype.

The Triton pack/unpack kernels are generated for each ``with fused_allreduce()``
site (they take the K pointers as K arguments, so no pointer table). This
module plans the buffers and launches them; CPU tensors take a torch path.

Generated kernels take, in order: the buffer, the K tensors, their K element
counts (0 for a tensor that is not in this buffer), their K offsets in the
buffer, and the first program id of tensors 1..K-1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime.groups import ensure_initialized
from macrogen.runtime.triton_support import triton, use_triton


@dataclass(frozen=True)
class FlatBuffer:
    """Where each member tensor lives in one flat buffer."""

    dtype: torch.dtype
    device: torch.device
    members: tuple[int, ...]  # indices into the K tensors
    sizes: tuple[int, ...]  # numel of each member
    offsets: tuple[int, ...]  # start of each member in the buffer

    @property
    def numel(self) -> int:
        return sum(self.sizes)


def plan(tensors: Sequence[torch.Tensor]) -> list[FlatBuffer]:
    """One buffer per (dtype, device), in order of first appearance; same on every rank."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    out = []
    for (dtype, device), members in groups.items():
        sizes = tuple(tensors[i].numel() for i in members)
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += n
        out.append(FlatBuffer(dtype, device, tuple(members), sizes, tuple(offsets)))
    return out


def kernel_args(
    buf: torch.Tensor, tensors: Sequence[torch.Tensor], flat: FlatBuffer, block: int
) -> tuple[list[Any], int]:
    """Positional arguments of a generated pack/unpack kernel, and its grid size."""
    k = len(tensors)
    numel, offset = [0] * k, [0] * k
    for i, n, off in zip(flat.members, flat.sizes, flat.offsets):
        numel[i], offset[i] = n, off
    first_block, at = [], 0
    for i in range(k):
        first_block.append(at)
        at += triton.cdiv(numel[i], block)
    # A tensor with nothing to copy here (another buffer's, or empty) gets the buffer as its
    # pointer: never read, and the kernel then compiles for this buffer's dtype and device only.
    pointers = [t if numel[i] else buf for i, t in enumerate(tensors)]
    return [buf, *pointers, *numel, *offset, *first_block[1:]], at


# The torch path uses the C++ helpers DDP buckets with (one call for all K tensors, not
# K Python-level views): half the per-call cost of torch.cat plus split for small tensors.


def pack_torch(tensors: Sequence[torch.Tensor], flat: FlatBuffer) -> torch.Tensor:
    """The members, flattened into one buffer (for one member it may be that member itself)."""
    return torch._C._nn.flatten_dense_tensors([tensors[i] for i in flat.members])


def unpack_torch(buf: torch.Tensor, tensors: Sequence[torch.Tensor], flat: FlatBuffer) -> None:
    members = [tensors[i] for i in flat.members]
    torch._foreach_copy_(members, torch._C._nn.unflatten_dense_tensors(buf, members))


def launch(
    kernel: Callable[..., Any],
    buf: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    flat: FlatBuffer,
    block: int,
) -> None:
    args, grid = kernel_args(buf, tensors, flat, block)
    if grid:
        kernel[(grid,)](*args, BLOCK=block)


def all_reduce_fused(
    tensors: Sequence[torch.Tensor],
    *,
    op: Any = None,
    group: dist.ProcessGroup | None = None,
    pack: Callable[..., Any],
    unpack: Callable[..., Any],
    block: int,
) -> None:
    """In place, like ``dist.all_reduce`` on each tensor, with one collective per dtype.

    Run without torchrun (no process group), this is world size 1: nothing changes.
    """
    if not ensure_initialized():
        return
    op = dist.ReduceOp.SUM if op is None else op
    _check_distinct(tensors)
    for flat in plan(tensors):
        members = [tensors[i] for i in flat.members]
        if use_triton(flat.device) and all(t.is_contiguous() for t in members):
            buf = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
            launch(pack, buf, tensors, flat, block)
            dist.all_reduce(buf, op=op, group=group)
            launch(unpack, buf, tensors, flat, block)
        else:
            buf = pack_torch(tensors, flat)
            dist.all_reduce(buf, op=op, group=group)
            unpack_torch(buf, tensors, flat)


def _check_distinct(tensors: Sequence[torch.Tensor]) -> None:
    """Two calls on the same memory reduce it twice serially, once fused: refuse, don't diverge."""
    starts = [t.data_ptr() for t in tensors if t.numel()]
    if len(set(starts)) != len(starts):
        raise ValueError(
            "fused_allreduce: two tensors of the block share memory; serially they would be"
            " reduced twice, fused once. Reduce each tensor once per block."
        )
