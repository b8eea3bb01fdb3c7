"""Fused all-reduce: K tensors, one flat buffer and one collective per dtype.

A ``with fused_allreduce()`` site expands to one ``FusedAllReduce`` object,
called as the K ``all_reduce`` calls it replaces. Its first call with given
shapes, dtypes and devices plans the work and allocates the flat buffers;
each later call with them (the steady state) costs, per dtype and device:

    pack    torch._foreach_copy_(views of the buffer, members)   one launch
    reduce  dist.all_reduce(buffer)                               one collective
    unpack  torch._foreach_copy_(members, views of the buffer)   one launch

and nothing else: no allocation, no host sync, no compilation, so on CUDA the
block can be captured in a CUDA graph. (A foreach copy is one kernel for up to
~20M elements; torch splits larger ones. Non-contiguous members are copied one
by one.) Fusion does not pay where there is nothing to fuse: a dtype with a
single member, or a member of at least ``DIRECT_BYTES``, is all-reduced in
place, as the serial call does.

Why torch's foreach copy and not a Triton kernel generated per site: measured
on an H100 (shared/GPU.md), the generated pack/unpack kernels copied at full
bandwidth but the block cost ~270 us of host time (Triton's launcher binds
4K + 1 arguments per call), so with mixed dtypes the fused block was slower
than the separate calls. A foreach copy is one C++ call, the same code on
every device (tested on CPU in CI), and needs no compilation.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

from macrogen.runtime.groups import ensure_initialized

# what dist.all_reduce takes as op: dist.ReduceOp.SUM is a RedOpType
ReduceOp: TypeAlias = "dist.ReduceOp | dist.ReduceOp.RedOpType"

# A member this large is reduced on its own: packing it would copy more than one collective's
# latency saves (16 MiB is ~10 us of copies at 3 TB/s; DDP's buckets are 25 MiB).
DIRECT_BYTES = 16 * 2**20
CACHE_SIZE = 8  # signatures remembered per site (a ragged last batch makes a second one)


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


# One-off flat buffers (data-parallel broadcast at start-up) use the C++ helpers DDP
# buckets with: one call for all K tensors, not K Python-level views.


def pack_torch(tensors: Sequence[torch.Tensor], flat: FlatBuffer) -> torch.Tensor:
    """The members, flattened into one buffer (for one member it may be that member itself)."""
    return torch._C._nn.flatten_dense_tensors([tensors[i] for i in flat.members])


def unpack_torch(buf: torch.Tensor, tensors: Sequence[torch.Tensor], flat: FlatBuffer) -> None:
    members = [tensors[i] for i in flat.members]
    torch._foreach_copy_(members, torch._C._nn.unflatten_dense_tensors(buf, members))


def release(buf: torch.Tensor, flat: FlatBuffer) -> None:
    """Free a one-off flat buffer (``pack_torch``'s) now, on this thread, once its collective
    is done. The process group's worker may hold the last reference to it and free it on its
    own thread, where a memory profiler never sees the free (autotune's tensor peak counted a
    start-up broadcast's buffer live through the whole step, on some runs of rank 0 only).
    One member's buffer is that member itself: it is kept."""
    if len(flat.members) > 1:
        buf.untyped_storage().resize_(0)


_signature = operator.attrgetter("dtype", "shape", "device")  # what a plan depends on


class FusedAllReduce:
    """The K ``dist.all_reduce`` calls of one ``fused_allreduce`` site, in place, fused.

    ``FusedAllReduce(3, where="train.py:12")(loss, correct, seen, op=None, group=None)``
    does what the three calls did. Run without a process group (no torchrun,
    no ``mg.launch()``) it is world size 1: nothing changes.
    """

    def __init__(self, k: int, *, where: str):
        self.k = k
        self.where = where
        self._plans: dict[
            tuple[object, ...], list[Step]
        ] = {}  # (dtype, shape, device) per tensor -> steps

    def __call__(
        self,
        *tensors: torch.Tensor,
        op: ReduceOp | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if len(tensors) != self.k:
            raise TypeError(
                f"fused_allreduce at {self.where}: {self.k} tensors, not {len(tensors)}"
            )
        if not ensure_initialized():
            return
        if len(set(map(torch.Tensor.data_ptr, tensors))) != self.k:  # cheap; then the exact check
            _check_distinct(tensors)
        op = dist.ReduceOp.SUM if op is None else op
        for step in self.steps(tensors):
            step.run(tensors, op, group)

    def steps(self, tensors: Sequence[torch.Tensor]) -> list[Step]:
        """What a call with these tensors does, planned once per shapes, dtypes and devices."""
        key = tuple(map(_signature, tensors))
        steps = self._plans.get(key)
        if steps is None:
            steps = []
            for flat in plan(tensors):
                alone = [
                    i for i, n in zip(flat.members, flat.sizes)
                    if len(flat.members) == 1 or n * tensors[i].element_size() >= DIRECT_BYTES
                ]  # fmt: skip
                steps += [Direct(i) for i in alone]
                rest = [i for i in flat.members if i not in alone]
                if rest:
                    steps.append(Packed(rest, tensors))
            if len(self._plans) >= CACHE_SIZE:
                del self._plans[next(iter(self._plans))]  # the oldest
            self._plans[key] = steps
        return steps


class Step:
    members: tuple[int, ...]  # indices into the K tensors, reduced by one collective

    def run(
        self,
        tensors: tuple[torch.Tensor, ...],
        op: ReduceOp,
        group: dist.ProcessGroup | None,
    ) -> None:
        raise NotImplementedError


class Packed(Step):
    """Members of one dtype and device: pack into a flat buffer, reduce it, unpack."""

    def __init__(self, members: list[int], tensors: Sequence[torch.Tensor]):
        self.members = tuple(members)
        first = tensors[members[0]]
        sizes = [tensors[i].numel() for i in members]
        self.buffer = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        # one view of the buffer per member, in the member's shape: made once, reused
        self.views = [v.view(tensors[i].shape) for i, v in zip(members, self.buffer.split(sizes))]
        self.every = self.members == tuple(range(len(tensors)))  # then no list to build per call

    def run(
        self,
        tensors: tuple[torch.Tensor, ...],
        op: ReduceOp,
        group: dist.ProcessGroup | None,
    ) -> None:
        members = tensors if self.every else [tensors[i] for i in self.members]
        torch._foreach_copy_(self.views, members)
        dist.all_reduce(self.buffer, op=op, group=group)
        torch._foreach_copy_(members, self.views)


class Direct(Step):
    """One member reduced in place: contiguous, or else through a buffer of its own."""

    def __init__(self, index: int):
        self.members = (index,)
        self.strided: Packed | None = None  # made the first time the member is a strided view

    def run(
        self,
        tensors: tuple[torch.Tensor, ...],
        op: ReduceOp,
        group: dist.ProcessGroup | None,
    ) -> None:
        t = tensors[self.members[0]]
        if t.is_contiguous():
            dist.all_reduce(t, op=op, group=group)
            return
        # gloo would reduce a strided view's storage as if it were contiguous: copy it out
        if self.strided is None:
            self.strided = Packed(list(self.members), tensors)
        self.strided.run(tensors, op, group)


def _check_distinct(tensors: Sequence[torch.Tensor]) -> None:
    """Two calls on the same memory reduce it twice serially, once fused: refuse, don't diverge."""
    starts = [t.data_ptr() for t in tensors if t.numel()]
    if len(set(starts)) != len(starts):
        raise ValueError(
            "fused_allreduce: two tensors of the block share memory; serially they would be"
            " reduced twice, fused once. Reduce each tensor once per block."
        )
