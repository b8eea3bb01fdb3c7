"""Sharded optimizer state (ZeRO stage 1) around any element-wise ``torch.optim`` optimizer.

    opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))

Every rank keeps optimizer state for 1/world of the parameters' elements only.
The parameters are cut into buckets as ``@data_parallel`` cuts them (reverse
registration order, one dtype and device each, about ``bucket_mb``), and each
bucket, flat, into ``world`` equal chunks (the last one padded):

    bucket 1 (first layers):  | wte.weight, blocks.0.attn.qkv.weight, ... | pad |
                              |<--- rank 0's chunk --->|<--- rank 1's chunk --->|
    bucket 0 (last layers):   | lm_head.weight, ln_f.weight, ln_f.bias | pad |

Each parameter is a view of its bucket's flat buffer (``ShardBucket.bind``):
the step writes this rank's chunk in place, the all-gather the others', and
nothing is copied between the parameters and the buffer (a parameter that
can't be a view, e.g. a strided one, is copied in before and out after).

One step, overlapped with the forward and backward around it:

1. during backward, as soon as a bucket's gradients are all in (in bucket order
   on every rank), they are copied into its send buffer and reduce-scattered
   asynchronously: each rank receives the sum of its chunk (on gloo as
   point-to-point sends, cheaper there than its reduce_scatter);
2. ``step()`` waits for them, scales by 1/world (the averaged gradients of its
   share) and steps this rank's *pieces* (the parts of each parameter in its
   chunks, 1-D views of the bucket's flat buffer) with the user's optimizer
   class and hyperparameters: ``fused=True`` as the user chose, else one
   ``foreach`` (multi-tensor) step over the share; consecutive pieces of one
   parameter group are stepped as one flat run (zero_runs.py);
3. ``step()`` then starts each bucket's all-gather asynchronously, the first
   layers' bucket first, and returns. A parameter is waited for when it is
   first read: a ``TorchFunctionMode`` (the guard) sees every torch operation until
   all buckets are in, and waits for the bucket of any parameter an operation
   takes. The next forward's first layers so run while later buckets arrive,
   and nothing reads a stale value: not the user's code between step() and the
   forward (logging, an EMA, ``state_dict()``, ``torch.save``, no_grad
   inference), not a second ``step()``, not the next backward (which waits for
   every bucket at its start).

Between a training backward and ``step()``, torch's ``clip_grad_norm_``,
``clip_grad_value_`` and a ``GradScaler``'s ``unscale_`` of the sent ``.grad``
tensors act on the averaged gradients, the shares (``zero_grads``): the norm is
the serial program's, and nothing is sent again.

The gradients sent during backward are used only if they are still the ones
``step()`` would read: every bucket was sent in the last backward, and no
``.grad`` was replaced or written since (tensor version counters: another
backward accumulating, an in-place write of another kind).
Otherwise (decided on all ranks together by one small all-reduce, so that all
issue the same collectives) every bucket is sent again from ``step()``, which
is the synchronous algorithm. With ``@data_parallel(accumulate=k)`` only the
k-th backward of a window sends; in a pipeline step none does (step() sends once).

A piece is an ordinary tensor of the parameter's elements, so any optimizer
whose update is element-wise (SGD, Adam, AdamW, Adagrad, RMSprop, ...) gives
the serial answer, parameter groups and learning-rate schedulers included:
``param_groups`` are the user's, copied into the pieces' groups at each step.
A parameter whose gradient is None on every rank keeps its pieces' gradients
None, so the optimizer skips it as it would serially (one flag per parameter
rides in the same reduce-scatter). ``state_dict()`` is the serial optimizer's
(consolidated: every rank gathers all pieces), and ``load_state_dict`` takes
it, so checkpoints move between serial, data-parallel and sharded runs.

A ``@data_parallel`` model whose parameters this optimizer holds is told not
to average its gradients: the reduce-scatter here does it.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from macrogen.runtime import groups, zero_runs
from macrogen.runtime.buckets import plan_buckets
from macrogen.runtime.eager import eager
from macrogen.runtime.mesh import data_parallel_group
from macrogen.runtime.zero_grads import ROUTED, SentGradients, ShardedGradientError

if TYPE_CHECKING:
    from macrogen.runtime.data_parallel import GradientSync

MB = 2**20

# Not element-wise: their update of one element depends on others (a closure over the
# whole model, factored row/column statistics, sparse gradients).
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam")


def _grad_ready(ref: weakref.ref[ShardedOptimizer], i: int, param: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._grad_ready(i)


# it finishes gathers and (un)installs the guard: Python state that dynamo runs eagerly
@eager
def _after_forward(ref: weakref.ref[ShardedOptimizer], *args: Any) -> None:
    opt = ref()
    if opt is not None:
        opt._after_forward()


def _model_sync(params: list[torch.Tensor], where: str) -> GradientSync:
    """The averaging of the one data-parallel model whose parameters these are."""
    from macrogen.runtime.data_parallel import syncs_of

    syncs = syncs_of(params)
    if not syncs:
        raise ValueError(
            f"{where}: the optimizer's parameters belong to no data-parallel model: shard the"
            " optimizer of a model built with mg.parallelize(model, dp='zero1') or of a"
            " @mg.data_parallel class (whose averaging the sharded optimizer takes over)"
        )
    if len(syncs) > 1:
        sites = ", ".join(s.where for s in syncs)
        raise ValueError(
            f"{where}: the optimizer holds the parameters of {len(syncs)} data-parallel models"
            f" ({sites}): shard one optimizer per model"
        )
    return syncs[0]


def _point_to_point(group: dist.ProcessGroup | None, device: torch.device) -> tuple[bool, bool]:
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
    ):
        self.params = [p for _, _, p in params]
        self.offsets: list[int] = []
        at = 0
        for _, _, p in params:
            self.offsets.append(at)
            at += p.numel()
        self.numel = at
        self.world, self.rank = world, rank
        self.p2p, self.p2p_gather = p2p  # reduce-scatter, all-gather as sends and receives
        self.chunk = max(1, math.ceil(at / world))
        p0 = self.params[0]
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
        for j, ((index, group, p), off) in enumerate(zip(params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                view = self.full[a:b]
                self.pieces.append(Piece(p, index, group, a - off, b - off, a - lo, view))
                self.piece_of.append(j)
        # where each parameter's elements go in the send buffer: (param, start, stop, dst view)
        self.spans: list[tuple[int, int, int, torch.Tensor]] = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            at = off
            while at < off + p.numel():
                r, c = divmod(at, self.chunk)
                stop = min(off + p.numel(), (r + 1) * self.chunk)
                self.spans.append((i, at - off, stop - off, self.send[r, c : c + stop - at]))
                at = stop
        # Each parameter's elements in ``full``; a parameter that can be is made a view of
        # them (``bound``), so the step writes it and the all-gather fills it in place.
        self.flats = [self.full[off : off + p.numel()] for p, off in zip(self.params, self.offsets)]
        self.ptrs = [f.data_ptr() for f in self.flats]
        self.bound = [False] * len(self.params)
        self.bind()
        self.reducing: list[Any] = []  # the reduce-scatter in flight (dist.Work)
        self.gathering: list[Any] = []  # the all-gather in flight
        self.taken: list[tuple[torch.Tensor | None, int]] = []  # each .grad sent, and its version

    # -- reduce-scatter ------------------------------------------------------------------------
    def launch_reduce(self, group: dist.ProcessGroup | None, tag: int) -> None:
        """Send the parameters' current gradients (asynchronously); remember which they were."""
        grads = [p.grad for p in self.params]
        self.taken = [(g, -1 if g is None else g._version) for g in grads]
        src, dst, empty = [], [], []
        for i, a, b, view in self.spans:
            g = grads[i]
            if g is None:
                empty.append(view)
            else:
                src.append(g.reshape(-1)[a:b])
                dst.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
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
            p.grad is not g or (g is not None and g._version != v)
            for p, (g, v) in zip(self.params, self.taken)
        )

    def finish_reduce(self) -> torch.Tensor:
        """This rank's chunk of the averaged gradients (``grad``); returns the use counts."""
        self.wait_reduce()
        self.taken = []
        if self.p2p:  # the sum in rank order, as one reduce-scatter would take it
            assert self.recv is not None
            rows = [self.send[r] if r == self.rank else self.recv[r] for r in range(self.world)]
            torch.add(rows[0], rows[1], out=self.grad)
            for row in rows[2:]:
                self.grad.add_(row)
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
                [pc.param.detach().reshape(-1)[pc.start : pc.stop] for pc in pieces],
            )

    def launch_gather(self, group: dist.ProcessGroup | None, tag: int) -> None:
        """Start sending every rank's updated share to every rank (asynchronously)."""
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
            torch._foreach_copy_(  # (in the parameter's own layout: reshape(-1) may copy)
                [self.params[i].detach() for i in unbound],
                [self.flats[i].view(self.params[i].shape) for i in unbound],
            )


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


# The runtime's own tensor operations while the guard is on (during backward, in step()):
# without it, each would pay the guard's ~10 us (about 1 ms per step on bench/ddp.py's GPT).
_UNWATCHED = torch._C.DisableTorchFunction


def _push_beneath_user_modes(guard: TorchFunctionMode) -> None:
    """Push ``guard`` on the torch-function stack beneath the modes already there (a user's
    ``with torch.device(...)``, say): their ``__exit__`` pops the top of the stack, which
    stays theirs, and operations pass through them to ours."""
    above = []
    while torch._C._len_torch_function_stack():
        above.append(torch._C._pop_torch_function_stack())
    guard.__enter__()
    for mode in reversed(above):
        torch._C._push_on_torch_function_stack(mode)


class _Guard(TorchFunctionMode):
    """Between ``step()`` and the arrival of the updated parameters, any torch operation on
    a parameter still in flight waits for its bucket first (and those launched before it).

    The forward's first layers so run while later buckets arrive, and nothing reads a
    stale parameter: not the forward, not the user between step() and forward (logging,
    an EMA, ``state_dict()``, ``torch.save``, ``no_grad`` inference), not a second step.

    From the end of a training forward to ``step()`` / ``zero_grad()``, norms, scalar
    writes and a GradScaler's unscale of gradients already sent act on their average
    (``zero_grads``): each rank's ``.grad`` is its local gradient, and
    ``torch.nn.utils.clip_grad_norm_`` of it would clip by a local norm.
    """

    def __init__(self, owner: ShardedOptimizer):
        super().__init__()
        self.owner = weakref.ref(owner)
        self.thread = threading.get_ident()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        owner = self.owner()
        if owner is not None:
            if owner._in_flight:
                owner._wait_for(args, kwargs)
            if owner.sent.grads and func in ROUTED:
                return owner.sent.route(func, args, kwargs)
        return func(*args, **kwargs)


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer``'s update, with its state sharded over the data-parallel group.

    ``sync`` is the ``GradientSync`` of the data-parallel model whose parameters the optimizer
    holds (``@data_parallel``, ``mg.parallelize(dp="zero1")``): its averaging stands down, and
    its forward and its accumulation window time this optimizer's. Without it, the one the
    parameters name (each parameter's ``SyncLink``, which the model registered); ``group``:
    the model's data-parallel group, unless given."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        sync: GradientSync | None = None,
        group: dist.ProcessGroup | None = None,
        where: str = "shard_optimizer",
        bucket_mb: float | None = None,
        first_bucket_mb: float | None = None,
    ):
        kind = type(optimizer)
        if kind.__name__ in NOT_ELEMENTWISE:
            raise TypeError(
                f"{where}: {kind.__name__} does not update each element on its own, so its"
                " state can't be sharded by elements; shard_optimizer supports element-wise"
                " optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ...)"
            )
        self.where = where
        order = [p for g in optimizer.param_groups for p in g["params"]]
        self.sync = sync if sync is not None else _model_sync(order, where)
        self._take_gradients(self.sync)
        group = group if group is not None else self.sync.group
        self.group = group
        self.world_size = groups.world_size(group)
        self.rank = groups.rank(group)
        saved = optimizer.state_dict() if optimizer.state else None
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._order = order
        group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        # Buckets over the parameters in the model's registration order (reversed: about
        # the order backward finishes them), as @data_parallel plans its own.
        known = {id(p): k for k, p in enumerate(self.sync.params)}
        ranked = sorted(range(len(order)), key=lambda i: known.get(id(order[i]), len(known) + i))
        config = self.sync.config
        mb = bucket_mb if bucket_mb is not None else config.bucket_mb
        first = first_bucket_mb if first_bucket_mb is not None else config.first_bucket_mb
        plan = plan_buckets(
            [order[i] for i in ranked],
            bucket_bytes=int(mb * MB),
            first_bucket_bytes=int(first * MB),
        )
        self.buckets: list[ShardBucket] = []
        self._slot: list[tuple[int, int]] = [(0, 0)] * len(order)  # param -> (bucket, position)
        self._members: list[list[int]] = []  # each bucket's parameters, by their order index
        for b, layout in enumerate(plan):
            members = [ranked[k] for k in layout.indices]
            self._members.append(members)
            p2p = _point_to_point(group, layout.device)
            bucket = ShardBucket(
                [(i, group_of[i], order[i]) for i in members], self.world_size, self.rank, p2p
            )
            self.buckets.append(bucket)
            for j, i in enumerate(members):
                self._slot[i] = (b, j)
        self.pieces = [pc for bucket in self.buckets for pc in bucket.pieces]
        # the share as flat runs (consecutive pieces of one group), for torch's element-wise
        # optimizers; one piece per parameter for any other class (zero_runs.py)
        self.runs = zero_runs.make_runs(self.buckets, flat=kind in zero_runs.FLAT_SAFE)
        # the user's optimizer class over this rank's runs: one local group per user group
        local_groups = []
        self._local_of: list[int] = []  # local group -> user group
        for g_index, g in enumerate(self.param_groups):
            mine = [t for run in self.runs if run.group == g_index for t in run.units()]
            if mine:
                local_groups.append({**_settings(g), "params": mine})
                self._local_of.append(g_index)
        # the constructor's own arguments only (AdamW's defaults also hold internal keys)
        accepted = inspect.signature(kind.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self._forced: dict[str, Any] = {}  # settings of the pieces' groups that are ours
        if kwargs.get("foreach", False) is None and not kwargs.get("fused"):
            # left to torch (a per-tensor loop on CPU): one multi-tensor step over the share
            self._forced["foreach"] = kwargs["foreach"] = True
            for g in local_groups:
                g.update(self._forced)
        # None: this rank's chunks hold only padding
        self.local = kind(local_groups, **kwargs) if local_groups else None
        # -- overlap: the state of one accumulation window (backwards up to a step) ----------
        self._in_flight: dict[int, int] = {}  # id(param) -> k: in the k-th bucket gathered
        self._gathers: list[ShardBucket] = []  # buckets in the order their all-gathers started
        self._done = 0  # all-gathers waited for and written
        self._guard: _Guard | None = None
        self._in_backward = False
        self._eager = False  # this backward reduce-scatters each bucket as it fills
        self._launched = 0  # buckets reduce-scattered in bucket order during backward
        self._stale = False  # a later backward accumulated into gradients already sent
        self._ready = bytearray(len(order))
        self._reduced = False  # the shares hold this window's averaged gradients
        self._window_ends = False  # the backward under way ends an accumulation window
        # the .grads the reduce-scatter took: torch's clipping and AMP on them act on the shares
        self.sent = SentGradients(
            self.buckets, len(order), group, self._ensure_reduced, where=where
        )
        self._guard_grads = False  # the guard stays on for self.sent until step/zero_grad
        named = {id(p): n for n, p in self.sync.module.named_parameters()}
        self.sent.names = [named.get(id(p), f"parameter {i}") for i, p in enumerate(order)]
        self.resends = 0  # steps whose gradients were all sent again from step() (counted)
        self._pending = [len(b.params) for b in self.buckets]
        self._hooks = []
        for i, p in enumerate(order):
            if p.requires_grad:
                hook = functools.partial(_grad_ready, weakref.ref(self), i)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        # the guard is not needed past the model's next forward
        after = functools.partial(_after_forward, weakref.ref(self))
        self._hooks.append(self.sync.module.register_forward_hook(after))
        # a newer sharded optimizer over the model takes the gradients (and the hooks) over
        old = self.sync.sharded_by() if self.sync.sharded_by is not None else None
        if old is not None and old is not self:
            old._unhook()
        self.sync.sharded_by = weakref.ref(self)
        if saved is not None:
            self.load_state_dict(saved)

    def _take_gradients(self, sync: GradientSync) -> None:
        """The data-parallel model leaves the averaging to us: the reduce-scatter does it."""
        if sync.local_sgd is not None:
            raise TypeError(
                f"{self.where}: shard_optimizer over a @data_parallel(sync_every=k > 1) model"
                f" ({sync.where}) is not supported: the sharded step averages every step"
            )
        sync.gradients_elsewhere = True

    def _unhook(self) -> None:
        """Another sharded optimizer took these parameters: step() communicates all at once."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- during backward: reduce-scatter each bucket as its gradients are in ---------------------
    def _grad_ready(self, i: int) -> None:
        if not self._in_backward:
            self._begin_backward()
        if not self._eager or self._ready[i]:
            return
        self._ready[i] = 1
        b, _ = self._slot[i]
        self._pending[b] -= 1
        while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
            self._launch_reduce(self._launched)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._reduced = False  # gradients anew: a clip_grad_norm_ before this is out of date
        self.finish_gather()  # the forward has read what it needed; the rest, now
        if self._launched:  # a second backward before step(): what was sent is out of date
            self._stale = True
        # With @data_parallel(accumulate=k), only the window's last backward sends.
        ends = self.sync.window_ends()
        self._window_ends = ends
        self.sent.clear()
        # a pipeline step's micro-batches (the model's averaged_once): which backward is the
        # last is not known here, so step() sends them once
        held = self.sync.held
        self._eager = ends and not self._stale and not held
        self._ready = bytearray(len(self._ready))
        self._pending = [len(b.params) for b in self.buckets]
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._in_backward = False
        if self._window_ends:  # step() averages these: a norm of them here is a local one
            self.sent.record(self._order)
        if self._eager:  # buckets a parameter's gradient never reached: as they are, in order
            while self._launched < len(self.buckets):
                self._launch_reduce(self._launched)
        self._eager = False

    def _launch_reduce(self, b: int) -> None:
        with _UNWATCHED():  # (runs in backward, under the guard: its checks are not needed)
            self.buckets[b].launch_reduce(self.group, tag=2 * b)
        self._launched = b + 1

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_gather()  # a second step without a forward in between
        if not self._reduced:
            self._reduce()
        else:  # (a clip has averaged and clipped them already): nothing written since
            written = self.sent.written_after_reduce(self._order)
            if written is not None:
                self._reduced = False
                raise ShardedGradientError(
                    f"{self.where}: the .grad of {written} was written after the gradients were"
                    " averaged (by a clip, or a norm of them): write gradients before clipping"
                )
        self._reduced = False
        self._unguard_grads()
        self._drop_guard()  # (the local step runs without it; pushed again below)
        if self.local is not None:
            for local, user in zip(self.local.param_groups, self._local_of):
                local.update(_settings(self.param_groups[user]), **self._forced)
            self.local.step()
        # The forward needs the first layers first: the last buckets (buckets run backwards).
        self._gathers, self._done = [], 0
        for b in reversed(range(len(self.buckets))):
            bucket = self.buckets[b]
            bucket.launch_gather(self.group, tag=2 * b + 1)
            for p in bucket.params:  # (a position, so that the guard compares ints)
                self._in_flight[id(p)] = len(self._gathers)
            self._gathers.append(bucket)
        if self._guard is None:  # (one left on the stack under a user's mode serves again)
            self._guard = _Guard(self)
            _push_beneath_user_modes(self._guard)
        return loss

    def _reduce(self) -> None:
        """Leave this rank's share of the averaged gradients in the pieces' ``.grad``."""
        with _UNWATCHED():  # our own bookkeeping: nothing in flight, no user norm
            self._reduce_now()

    def _reduce_now(self) -> None:
        # The gradients sent during backward are used only if every bucket went and none of
        # its gradients changed since (accumulated, clipped, unscaled): else all go again now.
        # Decided together, so that every rank issues the same collectives; the small
        # all-reduce that decides runs while the reduce-scatters finish.
        sent = self._launched == len(self.buckets) and not self._stale
        again = not sent or any(b.changed() for b in self.buckets)
        flag = torch.tensor([float(again)], device=self.buckets[0].full.device)
        agree = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        for bucket in self.buckets:
            bucket.wait_reduce()
        agree.wait()
        if flag.item():
            self.resends += 1
            for b, bucket in enumerate(self.buckets):
                bucket.launch_reduce(self.group, tag=2 * b)
        self._launched, self._stale = 0, False
        unused: set[int] = set()
        counts = [0] * len(self._order)  # each parameter: the ranks that had a gradient for it
        for b, bucket in enumerate(self.buckets):
            used = bucket.finish_reduce()
            if not bool((used > 0).all()):
                unused.update(
                    id(bucket.params[i]) for i in torch.nonzero(used == 0).flatten().tolist()
                )
            for j, n in enumerate(used.tolist()):
                counts[self._members[b][j]] = round(n)
            bucket.refresh()
        for run in self.runs:  # the optimizer skips a piece no rank had a gradient for
            if run.flat and unused and any(id(pc.param) in unused for pc in run.pieces):
                assert self.local is not None
                zero_runs.split(run, self.local)  # (for good: its pieces' steps now differ)
            if run.flat:
                run.tensor.grad = run.grad()
                continue
            for pc in run.pieces:
                grad = run.bucket.grad[pc.at : pc.at + pc.tensor.numel()]
                pc.tensor.grad = None if id(pc.param) in unused else grad
        self.sent.reduced(self._order, counts, self.world_size)
        self._reduced = True

    def _ensure_reduced(self) -> None:
        """The shares hold this window's averaged gradients (a clip's first operation)."""
        self.finish_gather()
        if not self._reduced:
            self._reduce()

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the averaged gradients, as the serial program's.

        Each rank's ``.grad`` holds only its local gradient, so torch's function would
        clip by a local norm. This waits for the reduce-scatters, takes the total norm
        from every rank's share (one all-reduce of one number) and scales the shares in
        place, with torch's coefficient; ``step()`` then steps the clipped shares.
        ``.grad`` is left as it is (local, unclipped). Returns the total norm.
        (``foreach`` is accepted for torch's signature: the shares are scaled by one
        multi-tensor operation.)
        """
        self.finish_gather()
        if not self._reduced:
            self._reduce()
        p = float(norm_type)
        shares = [bucket.grad[: bucket.chunk] for bucket in self.buckets]  # padding is 0
        norms = torch.stack(  # (half precision summed in float32)
            [
                torch.linalg.vector_norm(s, p, dtype=torch.promote_types(s.dtype, torch.float32))
                for s in shares
            ]
        )
        if p == math.inf:  # the largest over the ranks
            total, op = norms.max(), dist.ReduceOp.MAX
        else:  # sum of |g|^p (of nonzeros for p = 0) over the ranks
            total, op = (norms.sum() if p == 0 else (norms**p).sum()), dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=self.group)
        if p not in (0.0, math.inf):
            total = total ** (1.0 / p)
        total = total.to(shares[0].dtype)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is"
                " non-finite, so it cannot be clipped. To disable this error and scale the"
                " gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's, clamped
        torch._foreach_mul_(shares, coef)
        self.sent.written()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched and not self._in_backward:
            # sent, never stepped (a GradScaler skipped the step on every rank): discard
            for bucket in self.buckets:
                bucket.wait_reduce()
            self._launched, self._stale = 0, False
        self._reduced = False
        self._unguard_grads()
        super().zero_grad(set_to_none)
        self._drop_guard()

    # -- gradients sent: their norm is not the serial one -------------------------------------
    def _guard_gradients(self) -> None:
        """Keep the guard on from a training forward's end to step() / zero_grad()."""
        if self._guard is None:
            self._guard = _Guard(self)
            _push_beneath_user_modes(self._guard)
        self._guard_grads = True

    def _unguard_grads(self) -> None:
        self.sent.clear()
        self._guard_grads = False

    # -- the updated parameters: waited for where they are read ------------------------------
    def finish_gather(self) -> None:
        """Make every parameter current now (the guard waits only for those read).

        Call it before handing the parameters to code the guard can't see (another
        thread, a view of a parameter taken before ``step()``); the guard is also
        taken off the torch-function stack here, when it is on top.
        """
        if self._done < len(self._gathers):
            self._finish_upto(len(self._gathers) - 1)
        self._drop_guard()

    def _after_forward(self) -> None:
        """After the model's forward: the rest (parameters it did not read) now; then, for a
        training forward, the guard watches the gradients its backward will send."""
        self.finish_gather()
        if torch.is_grad_enabled():
            self._guard_gradients()

    def _finish_upto(self, k: int) -> None:
        """Write the all-gathers started first, up to the k-th, into the parameters."""
        while self._done <= k:
            bucket = self._gathers[self._done]
            for p in bucket.params:  # first: the copy below is an operation on them
                self._in_flight.pop(id(p), None)
            self._done += 1
            bucket.finish_gather()

    def _wait_for(self, args: Any, kwargs: dict[str, Any]) -> None:
        """Called by the guard on every torch operation: wait if it reads a parameter in flight."""
        flight = self._in_flight
        need = -1
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                k = flight.get(id(a), -1)
                need = k if k > need else need
            elif isinstance(a, (list, tuple)):  # torch.cat, torch._foreach_*
                for x in a:
                    if isinstance(x, torch.Tensor):
                        k = flight.get(id(x), -1)
                        need = k if k > need else need
        if need >= 0:
            self._finish_upto(need)

    def _drop_guard(self) -> None:
        """Take the guard off the torch-function stack once nothing is in flight."""
        guard = self._guard
        if guard is None or self._in_flight or self._guard_grads:
            return
        if guard.thread != threading.get_ident():
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is guard:
            torch._C._pop_torch_function_stack()
            self._guard = None

    # -- checkpoints: the serial optimizer's format ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The serial optimizer's state_dict (every rank gathers every piece)."""
        self.finish_gather()
        mine: list[tuple[int, int, int, int, dict[str, Any]]] = []
        if self.local is not None:
            for pc, piece in self._piece_states():
                if piece:
                    numel = pc.param.numel()
                    mine.append((pc.index, pc.start, pc.stop, numel, _to_cpu(piece)))
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        params = [p for g in self.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        flat_keys: dict[int, set[str]] = defaultdict(set)
        for pieces in everyone:
            for index, start, stop, numel, piece_state in pieces:
                full = state.setdefault(index, {})
                for key, value in piece_state.items():
                    if _is_elementwise(value, stop - start):
                        if key not in full:
                            full[key] = torch.zeros(numel, dtype=value.dtype)
                            flat_keys[index].add(key)
                        full[key][start:stop] = value.reshape(-1)
                    else:
                        full[key] = value  # replicated in every piece (e.g. Adam's "step")
        for index, keys in flat_keys.items():
            p = params[index]
            for key in keys:  # back to the parameter's shape and device, as serially
                state[index][key] = state[index][key].view(p.shape).to(p.device)
        groups_out = []
        at = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups_out.append({**_settings(g), "params": list(range(at, at + n))})
            at += n
        return {"state": state, "param_groups": groups_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a serial (consolidated) state_dict: each rank keeps its pieces' state."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{self.where}: the state_dict has {len(saved_groups)} parameter groups,"
                f" this optimizer {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, saved_groups):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(f"{self.where}: parameter group sizes differ from the state_dict")
            g.update(_settings(saved))
        # the saved group's parameter ids, in order, are our parameter indices
        ids = [i for g in saved_groups for i in g["params"]]
        saved_state = state_dict["state"]
        if self.local is None:
            return
        self.local.state.clear()
        for run in self.runs:
            states: list[dict[str, Any] | None] = []
            for pc in run.pieces:
                entry = saved_state.get(ids[pc.index])
                if entry is None:
                    states.append(None)
                    continue
                shape = pc.param.shape
                piece_state = {}
                for key, value in entry.items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape:
                        flat = value.reshape(-1)[pc.start : pc.stop]
                        piece_state[key] = flat.to(pc.tensor.device, copy=True)
                    else:  # replicated (e.g. Adam's "step")
                        piece_state[key] = value.clone() if torch.is_tensor(value) else value
                states.append(piece_state)
            zero_runs.load_run(run, self.local, states)
        for local, user in zip(self.local.param_groups, self._local_of):
            local.update(_settings(self.param_groups[user]), **self._forced)

    def _piece_states(self) -> list[tuple[Piece, dict[str, Any] | None]]:
        """Each piece's optimizer state (its slice of a flat run's)."""
        assert self.local is not None
        out: list[tuple[Piece, dict[str, Any] | None]] = []
        for run in self.runs:
            state = self.local.state.get(run.tensor) if run.flat else None
            for pc in run.pieces:
                if run.flat:
                    piece = zero_runs.piece_state(run, pc, state, view=True) if state else None
                else:
                    piece = self.local.state.get(pc.tensor)
                out.append((pc, piece))
        return out

    # -- measurement ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.local is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for state in self.local.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _is_elementwise(value: Any, piece_numel: int) -> bool:
    """A state entry with one value per element of the piece (not a replicated scalar)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece_numel


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def clip_grad_norm_(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip ``optimizer``'s gradients as the serial program would, sharded or not.

    A ``ShardedOptimizer``'s own ``clip_grad_norm_`` (the averaged gradients' norm);
    otherwise torch's over the optimizer's parameters (the unexpanded program, world size 1).
    """
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


def shard_optimizer(
    optimizer: torch.optim.Optimizer, *, where: str = "shard_optimizer"
) -> torch.optim.Optimizer:
    """``optimizer`` sharded over the data-parallel group; itself when the world size is 1."""
    from torch.distributed.tensor import DTensor

    sharded = [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, DTensor)]
    if sharded:  # FSDP's (or tensor-parallel) parameters: DTensors, not plain tensors
        raise ValueError(
            f"{where}: the optimizer's parameters are DTensors (mg.parallelize with dp='fsdp' or"
            " tp > 1): FSDP already shards the optimizer state, so shard_optimizer is redundant;"
            " use the optimizer as it is (with tp > 1, use dp='replicate')"
        )
    if groups.world_size(data_parallel_group()) == 1:
        return optimizer
    return ShardedOptimizer(optimizer, where=where)  # over its model's data-parallel group
