"""ZeRO-1's buckets: parameters of one dtype and device, flat, cut into one chunk per rank.

    bucket 1 (first layers):  | wte.weight, blocks.0.attn.qkv.weight, ... | pad |
                              |<--- rank 0's chunk --->|<--- rank 1's chunk --->|

A ``ShardBucket`` reduce-scatters its parameters' gradients (each rank receives
the sum of its chunk) and all-gathers the updated chunks back into the
parameters, which are views of its flat buffer where they can be. Rank r's
*pieces* are the parts of the parameters that fall in its chunk: what its
optimizer steps (``zero.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def elements(t: torch.Tensor) -> torch.Tensor:
    """The elements this rank holds of ``t``: a DTensor's local tensor (its tensor-parallel
    shard, what the data ranks divide), else ``t`` itself; detached, sharing its storage."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t.detach()


def point_to_point(group: dist.ProcessGroup | None, device: torch.device) -> tuple[bool, bool]:
    """(reduce-scatter, all-gather) as sends and receives: everywhere but NCCL on CUDA.

    gloo's reduce_scatter and all_gather copy through staging buffers: on 2 CPU
    ranks they cost about 1.3x and 0.8x an all_reduce of the same bucket in CPU
    time (2.1x together), where pairs of isend/irecv move the same bytes for
    about half that (docs/data_parallel.md, *Benchmark*). The sum is then taken
    here, in rank order, so each element's rounding depends neither on where it
    lies in its bucket nor on the bucket sizes (gloo's reduce_scatter sums an
    element in an order that depends on its position). On 2 ranks a + b is the
    same sum in either order: the same bits as gloo's.
    """
    if device.type == "cuda" and "nccl" in str(dist.get_backend(group)):
        return False, False
    return True, True


@dataclass
class Piece:
    """The part of one parameter that lies in this rank's chunk of its bucket."""

    param: torch.nn.Parameter  # the model's parameter
    index: int  # its position in the optimizer's parameter order (the state_dict key)
    group: int  # its parameter group
    start: int  # first element of the piece within the parameter
    stop: int
    at: int  # first element of the piece within the rank's chunk of the bucket
    tensor: torch.Tensor  # 1-D view into the bucket's gathered buffer: what the optimizer steps


class ShardBucket:
    """Parameters of one dtype and device, flat, cut into ``world`` chunks; chunk r is rank r's.

    ``send`` row j holds this rank's gradients of chunk j (and one used-flag per
    parameter); the reduce-scatter leaves ``grad``, this rank's chunk summed over
    the ranks. ``full`` is the parameters, flat: this rank's chunk (``mine``) is
    what its optimizer steps, and the all-gather fills in the others' chunks.
    """

    def __init__(
        self,
        params: list[tuple[int, int, torch.nn.Parameter]],
        world: int,
        rank: int,
        p2p: tuple[bool, bool],
        ranks: dist.ProcessGroup | None = None,
    ):
        self.group = ranks  # the ranks its chunks are cut over (the data group; ep: the experts')
        self.params = [p for _, _, p in params]
        # a DTensor parameter (tensor parallel) is its local shard here: the bucket holds,
        # reduce-scatters and gathers the elements this tensor rank has, over the data ranks
        self.sizes = [elements(p).numel() for p in self.params]
        self.offsets: list[int] = []
        at = 0
        for n in self.sizes:
            self.offsets.append(at)
            at += n
        self.numel = at
        self.world, self.rank = world, rank
        self.p2p, self.p2p_gather = p2p  # reduce-scatter, all-gather as sends and receives
        self.chunk = max(1, math.ceil(at / world))
        p0 = elements(self.params[0])
        kind: dict[str, Any] = dict(dtype=p0.dtype, device=p0.device)
        flags = len(params)  # one "used" flag per parameter after each chunk
        self.send = torch.zeros(world, self.chunk + flags, **kind)
        # rows the other ranks send us (point-to-point); row ``rank`` is unused
        self.recv = torch.zeros(world, self.chunk + flags, **kind) if self.p2p else None
        self.grad = torch.zeros(self.chunk + flags, **kind)  # the chunk summed, + use counts
        self.full = torch.zeros(self.chunk * world, **kind)
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        self.mine = self.full[lo:hi]  # the share: the optimizer steps views of it
        self.pieces: list[Piece] = []
        self.piece_of: list[int] = []  # each piece's parameter: its position in the bucket
        for j, ((index, group, p), off, n) in enumerate(zip(params, self.offsets, self.sizes)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                view = self.full[a:b]
                self.pieces.append(Piece(p, index, group, a - off, b - off, a - lo, view))
                self.piece_of.append(j)
        # where each parameter's elements go in the send buffer: (param, start, stop, dst view)
        self.spans: list[tuple[int, int, int, torch.Tensor]] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            at = off
            while at < off + n:
                r, c = divmod(at, self.chunk)
                stop = min(off + n, (r + 1) * self.chunk)
                self.spans.append((i, at - off, stop - off, self.send[r, c : c + stop - at]))
                at = stop
        # Each parameter's elements in ``full``; a parameter that can be is made a view of
        # them (``bound``), so the step writes it and the all-gather fills it in place.
        self.flats = [self.full[off : off + n] for off, n in zip(self.offsets, self.sizes)]
        self.ptrs = [f.data_ptr() for f in self.flats]
        self.bound = [False] * len(self.params)
        self.bind()
        self.reducing: list[Any] = []  # the reduce-scatter in flight (dist.Work)
        self.gathering: list[Any] = []  # the all-gather in flight
        self.taken: list[tuple[torch.Tensor | None, int]] = []  # each .grad sent, and its version
        self.weight: float | None = None  # this rank's gradient weight (dp_shares); None: 1/world

    # -- reduce-scatter ------------------------------------------------------------------------
    def launch_reduce(self, tag: int) -> None:
        """Send the parameters' current gradients (asynchronously); remember which they were."""
        group = self.group
        grads = [p.grad for p in self.params]
        self.taken = [(g, version_of(g)) for g in grads]
        mine = [None if g is None else elements(g).reshape(-1) for g in grads]
        src, dst, empty = [], [], []
        for i, a, b, view in self.spans:
            g = mine[i]
            if g is None:
                empty.append(view)
            else:
                src.append(g[a:b])
                dst.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
            if self.weight is not None:  # uneven shares: rows, not ranks, are averaged
                torch._foreach_mul_(dst, self.weight)
        if empty:
            torch._foreach_zero_(empty)
        used = torch.tensor([g is not None for g in grads], dtype=self.send.dtype)
        self.send[:, self.chunk :] = used.to(self.send.device)
        if not self.p2p:
            work = dist.reduce_scatter_single(
                self.grad, self.send.view(-1), group=group, async_op=True
            )
            self.reducing = [work]
            return
        assert self.recv is not None
        self.reducing = []
        for j in range(self.world):
            if j != self.rank:
                peer = _global(group, j)
                self.reducing.append(dist.isend(self.send[j], peer, group=group, tag=tag))
                self.reducing.append(dist.irecv(self.recv[j], peer, group=group, tag=tag))

    def changed(self) -> bool:
        """A gradient was replaced or written since it was sent (accumulated, clipped, unscaled)."""
        return any(
            p.grad is not g or (g is not None and version_of(g) != v)
            for p, (g, v) in zip(self.params, self.taken)
        )

    def finish_reduce(self) -> torch.Tensor:
        """This rank's chunk of the averaged gradients (``grad``); returns the use counts."""
        self.wait_reduce()
        self.taken = []
        if self.p2p:  # the sum in rank order, as one reduce-scatter would take it
            assert self.recv is not None
            rows = [self.send[r] if r == self.rank else self.recv[r] for r in range(self.world)]
            if len(rows) == 1:  # a group of one (ep's experts without replicas)
                self.grad.copy_(rows[0])
            else:
                torch.add(rows[0], rows[1], out=self.grad)
            for row in rows[2:]:
                self.grad.add_(row)
        if self.weight is None:  # (weighted: the sum is the average already)
            self.grad[: self.chunk].mul_(1.0 / self.world)
        return self.grad[self.chunk :]

    def wait_reduce(self) -> None:
        """Wait for the reduce-scatter in flight (if any), without reading it."""
        for work in self.reducing:
            work.wait()
        self.reducing = []

    # -- all-gather ------------------------------------------------------------------------------
    @torch.no_grad()
    def bind(self) -> None:
        """Make every parameter that can be a view of ``full`` one, its values copied in.

        A view needs no copy in before the step nor out after the all-gather: the
        step writes the share in place and the all-gather writes the rest. A
        parameter whose ``.data`` was replaced since (``p.data = ...``) is bound
        again; one that can't be a view (another dtype or device, a strided layout
        such as channels_last, a tensor subclass) is copied in and out instead.
        """
        for i, (p, flat, ptr) in enumerate(zip(self.params, self.flats, self.ptrs)):
            if self.bound[i] and p.data_ptr() == ptr:
                continue
            self.bound[i] = False
            if (
                type(p) is torch.nn.Parameter
                and p.numel() > 0
                and p.dtype == flat.dtype
                and p.device == flat.device
                and p.is_contiguous()
            ):
                flat.copy_(p.detach().reshape(-1))
                p.data = flat.view(p.shape)
                self.bound[i] = True

    def refresh(self) -> None:
        """Before the step: the share holds the parameters' current values.

        Bound parameters are the share; any other is copied in (it may have been loaded)."""
        self.bind()
        pieces = [pc for pc, j in zip(self.pieces, self.piece_of) if not self.bound[j]]
        if pieces:
            torch._foreach_copy_(
                [pc.tensor for pc in pieces],
                [elements(pc.param).reshape(-1)[pc.start : pc.stop] for pc in pieces],
            )

    def launch_gather(self, tag: int) -> None:
        """Start sending every rank's updated share to every rank (asynchronously)."""
        group = self.group
        if not self.p2p_gather:
            work = dist.all_gather_single(self.full, self.mine, group=group, async_op=True)
            self.gathering = [work]
            return
        self.gathering = []
        c = self.chunk
        for j in range(self.world):
            if j != self.rank:
                peer = _global(group, j)
                self.gathering.append(dist.isend(self.mine, peer, group=group, tag=tag))
                self.gathering.append(
                    dist.irecv(self.full[j * c : (j + 1) * c], peer, group=group, tag=tag)
                )

    def finish_gather(self) -> None:
        """Wait for the all-gather; copy the values into parameters that are not views."""
        for work in self.gathering:
            work.wait()
        self.gathering = []
        unbound = [i for i, b in enumerate(self.bound) if not b]
        if unbound:
            held = [elements(self.params[i]) for i in unbound]
            torch._foreach_copy_(  # (in the parameter's own layout: reshape(-1) may copy)
                held, [self.flats[i].view(t.shape) for i, t in zip(unbound, held)]
            )


def version_of(g: torch.Tensor | None) -> int:
    """A gradient's version counter (a DTensor's: its local tensor's, which in-place ops bump)."""
    if g is None:
        return -1
    return elements(g)._version if isinstance(g, DTensor) else g._version


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


# The runtime's own tensor operations while the guard is on (during backward, in step()):
# without it, each would pay the guard's ~10 us (about 1 ms per step on bench/ddp.py's GPT).
_UNWATCHED = torch._C.DisableTorchFunction
