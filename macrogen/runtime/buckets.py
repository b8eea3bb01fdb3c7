"""Gradient buckets: flat buffers whose slices are the parameters' ``.grad``.

    plan = plan_buckets(params, bucket_bytes=25 * 2**20, first_bucket_bytes=2**20)
    buckets = [Bucket(params, layout) for layout in plan]

Parameters are taken in reverse registration order (roughly the order backward
produces their gradients), grouped by dtype and device, and cut into buckets
of about ``bucket_bytes``; the first bucket is smaller so that communication
starts early in the backward pass. The plan depends only on the parameters'
order, shapes, dtypes and devices, so it is the same on every rank.

Each ``param.grad`` is a view into its bucket's flat buffer: autograd
accumulates straight into the buffer and the all-reduce reads it in place,
with no copy in either direction.

A tensor-parallel parameter is a DTensor (``mg.parallelize``): its bucket holds
its local shard's gradient, and its ``.grad`` is a DTensor over that view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from macrogen.kernels.grad_compress import compress, decompress


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank computes on and communicates); else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _as_grad(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``view`` as ``p``'s gradient: a DTensor with ``p``'s placements for a DTensor ``p``."""
    if not isinstance(p, DTensor):
        return view
    return DTensor.from_local(
        view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters share one flat buffer, and where each one lives in it."""

    indices: tuple[int, ...]  # into the parameter list, in launch order
    offsets: tuple[int, ...]  # start of each parameter's gradient in the buffer
    numel: int  # elements in the buffer
    dtype: torch.dtype
    device: torch.device


def plan_buckets(
    params: Sequence[torch.Tensor], *, bucket_bytes: int, first_bucket_bytes: int
) -> list[BucketLayout]:
    """Buckets over ``params`` in reverse order; a bucket closes once it holds ``bucket_bytes``."""
    layouts: list[BucketLayout] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}  # one open bucket per kind
    held: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes in each open bucket

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        indices = open_.pop(key)
        held.pop(key)
        offsets, at = [], 0
        for i in indices:
            offsets.append(at)
            at += local(params[i]).numel()
        layouts.append(BucketLayout(tuple(indices), tuple(offsets), at, *key))

    for i in reversed(range(len(params))):
        p = local(params[i])
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        held[key] = held.get(key, 0) + p.numel() * p.element_size()
        cap = first_bucket_bytes if not layouts else bucket_bytes
        if held[key] >= cap:
            close(key)
    for key in list(open_):
        close(key)
    return layouts


class Bucket:
    """One flat gradient buffer, its parameters' views, and its in-flight all-reduce."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: BucketLayout,
        *,
        comm_dtype: torch.dtype | None,
        extra: int = 0,
    ):
        self.layout = layout
        self.params = [params[i] for i in layout.indices]
        # ``extra`` trailing elements ride along in the same collective (the used-flags)
        self.buffer = torch.zeros(layout.numel + extra, dtype=layout.dtype, device=layout.device)
        self.grads = self.buffer[: layout.numel]
        self.extra = self.buffer[layout.numel :]
        self.views = [
            self.grads[off : off + local(p).numel()].view_as(local(p))
            for p, off in zip(self.params, layout.offsets)
        ]
        # what each parameter's .grad is made (the view itself, or a DTensor over it)
        self.grad_views = [_as_grad(v, p) for v, p in zip(self.views, self.params)]
        # a half-precision copy to send, when compressing (same length as the buffer)
        self.comm = (
            None
            if comm_dtype is None or comm_dtype == layout.dtype
            else torch.empty_like(self.buffer, dtype=comm_dtype)
        )
        if self.comm is not None:
            self.comm_views = [
                self.comm[off : off + local(p).numel()]
                for p, off in zip(self.params, layout.offsets)
            ]
            self.comm_extra = self.comm[layout.numel :]
        # gradient already in the outgoing buffer, scaled by 1/world size (compressed, if so)
        self.scaled = [False] * len(self.params)
        self.work: dist.Work | None = None

    def take(self, i: int, scale: float) -> None:
        """Parameter ``i``'s gradient is complete: make it the view, and send it scaled.

        After ``zero_grad()`` (set to None) autograd hands over a fresh gradient:
        it goes into the outgoing buffer in one pass, scaled by 1/world size on
        the way (and rounded, when compressing: the view is then filled when the
        sum comes back). That is cheaper than zeroing the buffer before backward,
        accumulating into it and scaling it. A gradient that already is the view
        (accumulation, ``set_to_none=False``) is scaled at launch instead.
        """
        p, view = self.params[i], self.views[i]
        if p.grad is self.grad_views[i]:
            return
        if p.grad is None:  # no gradient reached it (an unused parameter): send zeros
            view.zero_()
            if self.comm is not None:
                self.comm_views[i].zero_()
        elif self.comm is not None:
            compress(local(p.grad).reshape(-1), self.comm_views[i], scale)
        else:
            torch.mul(local(p.grad), scale, out=view)
        p.grad = self.grad_views[i]
        self.scaled[i] = True

    def launch(self, group: dist.ProcessGroup | None, scale: float) -> None:
        """Start averaging the buffer over ``group`` (asynchronously)."""
        unscaled = [i for i, done in enumerate(self.scaled) if not done]
        self.scaled = [False] * len(self.params)
        if self.comm is not None:
            if len(unscaled) == len(self.params):
                compress(self.buffer, self.comm, scale)  # one pass: scale, round, into comm
            else:
                for i in unscaled:
                    compress(self.views[i].reshape(-1), self.comm_views[i], scale)
                compress(self.extra, self.comm_extra, scale)
            self.work = dist.all_reduce(self.comm, group=group, async_op=True)
            return
        if len(unscaled) == len(self.params):
            self.grads.mul_(scale)
        elif unscaled:
            torch._foreach_mul_([self.views[i] for i in unscaled], scale)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    def wait(self) -> None:
        assert self.work is not None, "wait() before launch()"
        self.work.wait()
        self.work = None
        if self.comm is not None:
            decompress(self.comm, self.buffer)
