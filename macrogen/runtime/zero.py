"""Sharded optimizer state (ZeRO stage 1) around any element-wise ``torch.optim`` optimizer.

    opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))

Every rank keeps optimizer state for 1/world of the parameters' elements only.
The parameters are cut into buckets as ``@data_parallel`` cuts them (reverse
registration order, one dtype and device each, about ``bucket_mb``), and each
bucket, flat, into ``world`` equal chunks (the last one padded):

    bucket 1 (first layers):  | wte.weight, blocks.0.attn.qkv.weight, ... | pad |
                              |<--- rank 0's chunk --->|<--- rank 1's chunk --->|
    bucket 0 (last layers):   | lm_head.weight, ln_f.weight, ln_f.bias | pad |

(``zero_buckets``: the buckets and their collectives; ``zero_runs``: the share
stepped as flat runs; ``zero_guard``: what is watched between steps;
``zero_grads``: clipping and AMP of the sent gradients; ``zero_state``: the
serial optimizer's state_dict.)

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

Tensor-parallel parameters (DTensors: ``mg.parallelize(tp=..., dp="zero1")``, a
``@tensor_parallel`` model) are held by their local tensors (``to_local()``): each tensor
rank's shards are what its data ranks divide, over the model's data group. They are copied
into the buckets and out (never views), all gathered before the model's forward (which
reads the local tensors, out of the guard's sight), and a norm's parts of a parameter the
tensor ranks split are summed over the tensor group too (``zero_tensor``).

Over an expert-parallel model (``mg.parallelize(ep=E, dp="zero1")``) the experts' buckets are
cut over their replica group instead, the ranks holding the same experts (``zero_experts``).

The optimizer's parameters are those of one data-parallel model (``@data_parallel``,
``mg.parallelize(dp="zero1")``), whose averaging it takes over: the model's
``GradientSync`` stands down, the reduce-scatter here averages.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from macrogen.runtime import groups, zero_runs, zero_state
from macrogen.runtime.buckets import plan_buckets
from macrogen.runtime.eager import eager
from macrogen.runtime.zero_buckets import ShardBucket, point_to_point
from macrogen.runtime.zero_experts import Cut, expert_cut
from macrogen.runtime.zero_grads import (
    SentGradients,
    ShardedGradientError,
    clip_parts,
    clip_shares,
)
from macrogen.runtime.zero_guard import UNWATCHED, Watch
from macrogen.runtime.zero_tensor import TensorShards

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


@eager
def _before_forward(ref: weakref.ref[ShardedOptimizer], *args: Any) -> None:
    opt = ref()
    if opt is not None:
        opt.finish_gather()


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
        # ep: the experts' buckets are cut over their replica group, after the rest's
        self.experts = expert_cut(self.sync.module, order, where)
        experts = self.experts.experts if self.experts is not None else frozenset()
        cuts = [(Cut(group, self.world_size, self.rank), [i for i in ranked if i not in experts])]
        if self.experts is not None:
            cuts.append((self.experts.cut, [i for i in ranked if i in experts]))
        self.buckets: list[ShardBucket] = []
        self._slot: list[tuple[int, int]] = [(0, 0)] * len(order)  # param -> (bucket, position)
        self._members: list[list[int]] = []  # each bucket's parameters, by their order index
        for cut, part in cuts:
            plan = plan_buckets(
                [order[i] for i in part],
                bucket_bytes=int(mb * MB),
                first_bucket_bytes=int(first * MB),
            )
            for layout in plan:
                members = [part[k] for k in layout.indices]
                self._members.append(members)
                p2p = point_to_point(cut.group, layout.device)
                bucket = ShardBucket([(i, group_of[i], order[i]) for i in members], cut.world,
                                     cut.rank, p2p, cut.group)  # fmt: skip
                for j, i in enumerate(members):
                    self._slot[i] = (len(self.buckets), j)
                self.buckets.append(bucket)
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
                local_groups.append({**zero_state.settings(g), "params": mine})
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
        self._in_backward = False
        self._eager = False  # this backward reduce-scatters each bucket as it fills
        self._launched = 0  # buckets reduce-scattered in bucket order during backward
        self._stale = False  # a later backward accumulated into gradients already sent
        self._ready = bytearray(len(order))
        self._reduced = False  # the shares hold this window's averaged gradients
        self._window_ends = False  # the backward under way ends an accumulation window
        # the .grads the reduce-scatter took: torch's clipping and AMP on them act on the shares
        named = {id(p): n for n, p in self.sync.module.named_parameters()}
        names = [named.get(id(p), f"parameter {i}") for i, p in enumerate(order)]
        # tensor-parallel (DTensor) parameters: their norms' parts are summed over T too
        self.shards = TensorShards(order)
        self.sent = SentGradients(
            self.buckets, names, group, self._ensure_reduced, where=where, shards=self.shards
        )
        # the parameters in flight after a step, the gradients sent before it: the guard's
        self.watch = Watch(self.sent)
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
        if any(isinstance(p, DTensor) for p in order):
            # The forward reads a DTensor parameter through its local tensor (the tensor-
            # parallel swap, out of the guard's sight): every gather is in before it starts.
            # (Between step() and the forward the guard still sees reads of the DTensors.)
            before = functools.partial(_before_forward, weakref.ref(self))
            self._hooks.append(self.sync.module.register_forward_pre_hook(before, prepend=True))
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
        self.buckets[b].weight = None if self.sync.shares is None else self.sync.shares.weight
        with UNWATCHED():  # (runs in backward, under the guard: its checks are not needed)
            self.buckets[b].launch_reduce(tag=2 * b)
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
        self.watch.unwatch_gradients()
        self.watch.drop()  # (the local step runs without the guard; pushed again below)
        if self.local is not None:
            for local, user in zip(self.local.param_groups, self._local_of):
                local.update(zero_state.settings(self.param_groups[user]), **self._forced)
            self.local.step()
        # The forward needs the first layers first: the last buckets (buckets run backwards).
        self.watch.start_gathers(self.buckets, self._launch_gather)
        return loss

    def _launch_gather(self, b: int) -> None:
        self.buckets[b].launch_gather(tag=2 * b + 1)

    def _reduce(self) -> None:
        """Leave this rank's share of the averaged gradients in the pieces' ``.grad``."""
        with UNWATCHED():  # our own bookkeeping: nothing in flight, no user norm
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
                bucket.weight = None if self.sync.shares is None else self.sync.shares.weight
                bucket.launch_reduce(tag=2 * b)
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
        self.sent.reduced(self._order, counts, [self.buckets[b].world for b, _ in self._slot])
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
        self._ensure_reduced()
        if self.shards:  # tensor-parallel shards: the norm's parts summed over T per parameter
            parts = self.sent.averaged_parts(float(norm_type))
            total = clip_parts(self.buckets, parts, max_norm, norm_type, error_if_nonfinite)
        else:
            total = clip_shares(self.buckets, self.group, max_norm, norm_type, error_if_nonfinite)
        self.sent.written()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched and not self._in_backward:
            # sent, never stepped (a GradScaler skipped the step on every rank): discard
            for bucket in self.buckets:
                bucket.wait_reduce()
            self._launched, self._stale = 0, False
        self._reduced = False
        self.watch.unwatch_gradients()
        super().zero_grad(set_to_none)
        self.watch.drop()

    # -- the updated parameters: waited for where they are read (zero_guard) -----------------
    def finish_gather(self) -> None:
        """Make every parameter current now (the guard waits only for those read).

        Call it before handing the parameters to code the guard can't see (another
        thread, a view of a parameter taken before ``step()``); the guard is also
        taken off the torch-function stack here, when it is on top.
        """
        self.watch.finish()

    def _after_forward(self) -> None:
        """After the model's forward: the rest (parameters it did not read) now; then, for a
        training forward, the guard watches the gradients its backward will send."""
        self.watch.finish()
        if torch.is_grad_enabled():
            self.watch.watch_gradients()

    # -- checkpoints: the serial optimizer's format ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The serial optimizer's state_dict (every rank gathers every piece: call it on all)."""
        self.finish_gather()
        return zero_state.consolidated(
            self.runs, self.local, self.param_groups, self.world_size, self.group, self.experts
        )

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
            g.update(zero_state.settings(saved))
        if self.local is None:
            return
        # the saved groups' parameter ids, in order, are our parameter indices
        ids = [i for g in saved_groups for i in g["params"]]
        zero_state.load(self.runs, self.local, state_dict["state"], ids)
        for local, user in zip(self.local.param_groups, self._local_of):
            local.update(zero_state.settings(self.param_groups[user]), **self._forced)

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


def shard_optimizer(
    optimizer: torch.optim.Optimizer, *, where: str = "shard_optimizer"
) -> torch.optim.Optimizer:
    """``optimizer`` sharded over its model's data-parallel group; itself when that group (or
    the job) has one rank.

    Tensor-parallel (DTensor) parameters are sharded by their local tensors: each tensor
    rank's shard is what its data ranks divide. A parameter split over the data ranks
    already (FSDP's) is refused: FSDP shards the optimizer state itself."""
    from macrogen.runtime.data_parallel import syncs_of

    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:  # (split over "tensor", or ep's experts over "ep": held by local tensors)
        if isinstance(p, DTensor) and any(
            not placement.is_replicate() and name not in ("tensor", "ep")
            for placement, name in zip(p.placements, p.device_mesh.mesh_dim_names or ())
        ):
            raise ValueError(
                f"{where}: the optimizer's parameters are sharded over the data ranks already"
                " (mg.parallelize with dp='fsdp'): FSDP shards the optimizer state itself, so"
                " shard_optimizer is redundant; use the optimizer as it is"
            )
    if groups.world_size() == 1:
        return optimizer
    syncs = syncs_of(params)
    if len(syncs) == 1 and syncs[0].world_size == 1:  # one data rank (tp = world size)
        return optimizer
    return ShardedOptimizer(optimizer, where=where)  # over its model's data-parallel group
