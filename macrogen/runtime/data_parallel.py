"""Gradient averaging for ``@data_parallel`` modules: buckets, overlap, accumulation.

A generated ``@data_parallel`` class makes one ``GradientSync`` at the end of
its ``__init__``. From then on, with no change to the training loop:

- the first forward (when the model sits on its device) plans the buckets,
  checks that every rank built the same model, and broadcasts rank 0's
  parameters and buffers;
- during backward, each parameter's finished gradient becomes a view into
  its bucket's flat buffer (a fresh one is moved in, scaled by 1/world size
  on the way), and a bucket's all-reduce starts as soon as all of its
  gradients are in, in bucket order on every rank;
- at the end of backward (an autograd-engine callback) the remaining buckets
  are launched and all are waited for, so ``optimizer.step()`` reads averaged
  gradients.

With ``accumulate=k`` only every k-th backward communicates; the backwards in
between accumulate locally into the same buffers. A pipeline step runs one
backward per micro-batch: under ``averaged_once()`` they all accumulate and
count as one backward, and the sum is averaged once when it ends (DDP's
``no_sync`` for all but the last, as torch's pipeline schedules do), not once
per micro-batch.

Unused parameters: a bucket whose parameter got no gradient this backward
is launched at the end of backward with that parameter's gradient as it is
(zero after ``zero_grad``). One flag per parameter rides in the last bucket,
so every rank learns which parameters no rank used; their ``.grad`` is reset
to ``None`` if it was ``None`` before, as in the serial program.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from macrogen.kernels.grad_compress import COMM_DTYPES
from macrogen.runtime import class_plans, fused, groups
from macrogen.runtime.agreement import Fingerprint, check_agreement, fingerprint
from macrogen.runtime.buckets import Bucket, local, plan_buckets
from macrogen.runtime.eager import eager
from macrogen.runtime.local_sgd import LocalSGD, OuterSGD
from macrogen.runtime.mesh import Mesh
from macrogen.runtime.shares import ShareConfig, Shares

MB = 2**20
LINK = "_mg_gradient_sync"  # a parameter's attribute: the SyncLink to its model's GradientSync


@dataclass(frozen=True)
class DataParallelConfig:
    bucket_mb: float = 25  # MiB per bucket: fewer, larger collectives vs. earlier overlap
    first_bucket_mb: float = 1  # the first bucket is small so communication starts early
    compress: str | None = None  # "bf16" / "fp16": all-reduce a half-precision copy
    accumulate: int = 1  # communicate on every k-th backward only
    broadcast_buffers: bool = True  # copy rank 0's buffers to all ranks before each forward
    sync_every: int = 1  # >1: local SGD, parameters averaged every k optimizer steps
    sync_warmup: int = 0  # with sync_every > 1: this many fully synchronous steps first
    outer: OuterSGD | None = None  # local SGD's outer optimizer (DiLoCo); None: average
    overlap: bool = False  # the synchronization's all-reduce runs during the next steps
    delay: int = 1  # with overlap: inner steps between its start and its use (<= sync_every)
    # uneven rows of one global batch per rank (mg.shard): "even", "measured" or proportions;
    # None: each rank trains on its own batch, gradients averaged evenly
    shares: str | tuple[float, ...] | None = None
    rebalance_every: int = 10  # shares="measured": steps between two measurements
    max_rows: int | tuple[int, ...] | None = None  # with shares: each rank's cap in rows

    def describe(self) -> str:
        shares = (
            ""
            if self.shares is None
            else f", shares={self.shares!r}, rebalance_every={self.rebalance_every!r},"
            f" max_rows={self.max_rows!r}"
        )
        return (
            f"bucket_mb={self.bucket_mb!r}, first_bucket_mb={self.first_bucket_mb!r},"
            f" compress={self.compress!r}, accumulate={self.accumulate!r},"
            f" broadcast_buffers={self.broadcast_buffers!r}, sync_every={self.sync_every!r},"
            f" sync_warmup={self.sync_warmup!r}"
            + (
                f", outer={self.outer!r}, overlap={self.overlap!r}, delay={self.delay!r}"
                if self.outer is not None or self.overlap
                else ""
            )
            + shares
        )


class GradientSync:
    """Averages ``module``'s gradients over the data-parallel group; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        config: DataParallelConfig,
        *,
        where: str,
        mesh: Mesh,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"@data_parallel at {where} needs an nn.Module subclass")
        for name, sub in module.named_modules():
            if sub is not module and any(isinstance(v, GradientSync) for v in vars(sub).values()):
                raise TypeError(
                    f"@data_parallel at {where}: its submodule {name!r} is @data_parallel too;"
                    " put @data_parallel on the outermost model only"
                )
        self.module = module
        self.config = config
        self.where = where
        # Tensor-parallel shards wait for the outermost decorated model's construction to end;
        # this one's may still be running, so cut them now, on the same mesh, before the
        # parameters are collected.
        class_plans.materialize(module, mesh)
        # the data dim of the mesh the model is parallelized on, handed over by its apply step
        # (mg.parallelize's, @data_parallel's, the parameter servers' workers)
        self.group = mesh.data_group
        self.world_size = groups.world_size(self.group)
        self.scale = 1.0 / self.world_size  # gradients are averaged: scaled, then summed
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.param_ids: set[int] = set()  # (of self.params: the parameters this one averages)
        self.plan_id = 0  # gradient hooks of an earlier plan (a replaced parameter's) do nothing
        self.buckets: list[Bucket] = []  # planned at the first forward, on the parameters' device
        self.slot: list[tuple[int, int]] = []  # parameter -> (bucket, position in it)
        self.started = False
        self.backwards = 0  # backward passes so far (accumulate counts them)
        self.gradients_elsewhere = False  # a sharded optimizer reduces the gradients itself
        self.held = False  # inside averaged_once(): backwards accumulate, its end averages
        self.replanned: list[str] = []  # why the buckets were planned again (a replaced parameter)
        # the sharded optimizer that reduce-scatters these gradients instead (it registers)
        self.sharded_by: weakref.ref[Any] | None = None
        local = config.sync_every > 1 or config.outer is not None or config.overlap
        self.local_sgd = LocalSGD(self) if local else None
        self.buffers = BufferBroadcast(self.group)
        self.shares = self._shares() if config.shares is not None else None
        self._collect()
        self._reset_window()
        if self.world_size == 1:
            return  # serial: plain autograd gradients, nothing to average
        # first, before other hooks (mg.parallelize's swap to local tensors) change the parameters
        module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _shares(self) -> Shares | None:
        """The split of each global batch over the data ranks (None: serial, nothing to split)."""
        if self.config.accumulate != 1 or self.local_sgd is not None:
            raise ValueError(
                f"{self.where}: dp_shares weights each step's gradients by its rows, and takes"
                " accumulate=1 and no local SGD (sync_every, outer, overlap)"
            )
        if self.world_size == 1:
            return None
        assert self.config.shares is not None
        config = ShareConfig(self.config.shares, self.config.rebalance_every, self.config.max_rows)
        return Shares(config, self.group, self.world_size, groups.rank(self.group), self.where)

    def shard(self, batch: Any) -> Any:
        """This rank's rows of the global ``batch`` (``mg.shard``); its gradients are weighted
        by its rows from now until the next call."""
        if self.shares is None:
            if self.world_size == 1:
                return batch
            raise RuntimeError(
                f"mg.shard: the model of {self.where} splits no global batch: give it"
                ' dp_shares="measured" (or "even", or one share per data rank)'
            )
        device = local(self.params[0]).device if self.params else torch.device("cpu")
        part = self.shares.take(batch, device)
        self.scale = self.shares.weight
        return part

    def _collect(self) -> None:
        """The module's parameters that need gradients, each with a gradient hook."""
        self.plan_id += 1
        # (expert-parallel experts are averaged over their replica group by expert_parallel)
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and not getattr(p, "_mg_averaged_by_experts", False)]  # fmt: skip
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.param_ids = {id(p) for p in self.params}
        for p in self.params:  # each parameter names its model's averaging (see syncs_of)
            setattr(p, LINK, SyncLink(self))
        if self.world_size == 1:
            return
        # (not removed on a re-plan: a deep copy of the model shares the handles' targets)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(
                functools.partial(self._grad_ready, self.plan_id, i)
            )

    def params_changed(self) -> str | None:
        """Which parameter was added, replaced or removed since the plan (None: none).

        ``m.w = nn.Parameter(...)`` after construction (nanoGPT's crop_block_size)
        leaves the planned buckets holding the old tensor: the new one would get
        no hook and never be averaged, and every rank would silently train its own
        copy. Checked on every training forward: one pass of identity tests.
        """
        current = [p for p in self.module.parameters() if p.requires_grad]
        if len(current) == len(self.params) and all(a is b for a, b in zip(current, self.params)):
            return None
        named = {id(p): n for n, p in self.module.named_parameters() if p.requires_grad}
        for p, name in zip(self.params, self.names):
            if id(p) not in named:
                return f"{name!r} was replaced, removed or frozen"
        planned = {id(p) for p in self.params}
        for pid, name in named.items():
            if pid not in planned:
                return f"{name!r} is new"
        return "the parameters were reordered"

    # -- start-up --------------------------------------------------------------
    def restart(self) -> None:
        """Parameters moved or changed dtype (``model.to(...)``): plan again at the next forward."""
        self.started = False

    def _start(self) -> None:
        if self.params_changed() is not None:  # e.g. replaced between __init__ and this forward
            self._collect()
        plan = plan_buckets(
            self.params,
            bucket_bytes=int(self.config.bucket_mb * MB),
            first_bucket_bytes=int(self.config.first_bucket_mb * MB),
        )
        comm_dtype = COMM_DTYPES.get(self.config.compress or "")
        self.buckets = [
            # the last bucket carries one used-flag per parameter (see _settle_unused)
            Bucket(
                self.params,
                layout,
                comm_dtype=comm_dtype,
                extra=len(self.params) * (b == len(plan) - 1),
            )
            for b, layout in enumerate(plan)
        ]
        self.slot = [(0, 0)] * len(self.params)
        for b, layout in enumerate(plan):
            for j, i in enumerate(layout.indices):
                self.slot[i] = (b, j)
        check_agreement(self._fingerprint(), group=self.group, where=self.where)
        broadcast(self.params, self.group)
        broadcast(list(self.module.buffers()), self.group)
        self.started = True
        self._reset_window()

    def _fingerprint(self) -> Fingerprint:
        return fingerprint(
            self.names,
            [tuple(p.shape) for p in self.params],
            [str(p.dtype).removeprefix("torch.") for p in self.params],
            [b for b, _ in self.slot],
            self.config.describe(),
        )

    # -- forward ---------------------------------------------------------------
    # Start-up (agreement check, broadcasts) and the identity checks talk to process groups
    # and mutate Python state: under torch.compile they run eagerly, outside the graph.
    @eager
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # Inference (torch.no_grad(), often on rank 0 only) takes part in no collective:
        # it neither starts up nor re-plans nor broadcasts buffers, as DDP under no_grad.
        if not torch.is_grad_enabled():
            return
        changed = self.params_changed() if self.started else None
        if changed is not None:  # a parameter was replaced: plan the buckets again
            self.replanned.append(changed)
            self.started = False
        if not self.started:
            self._start()
        if self.config.broadcast_buffers and module.training:
            self.buffers.broadcast(list(module.buffers()))

    # -- backward --------------------------------------------------------------
    def _grad_ready(self, plan_id: int, i: int, param: torch.Tensor) -> None:
        # runs once per parameter per backward: keep it short
        if plan_id != self.plan_id:
            return
        if not self.in_backward:
            self._begin_backward()
        self.used[i] = 1
        if not self.syncing or self.ready[i]:
            return
        self.ready[i] = 1
        b, j = self.slot[i]
        self.buckets[b].take(j, self.scale)
        self.pending[b] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch(self.launched)

    def _begin_backward(self) -> None:
        if not self.started:
            raise RuntimeError(
                f"data_parallel at {self.where}: a gradient reached a parameter before the model's"
                " first forward; call the model itself (not only its submodules) before backward"
            )
        if self.shares is not None and not self.shares.taken:
            raise RuntimeError(
                f"data_parallel at {self.where}: with dp_shares each step's batch is the global"
                " one, cut by mg.shard(model, batch) before the forward; this backward's was not"
            )
        self.in_backward = True
        k = self.config.accumulate
        self.syncing = self.backwards % k == k - 1  # this backward communicates
        if self.held or self._elsewhere():
            self.syncing = False  # gradients stay local: the optimizer, averaging or the end syncs
        self.ready = bytearray(len(self.params))
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def window_ends(self) -> bool:
        """The backward under way (or the next one) is the last of its ``accumulate`` window."""
        k = self.config.accumulate
        return self.backwards % k == k - 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if b == len(self.buckets) - 1:
            bucket.extra.copy_(torch.frombuffer(self.used, dtype=torch.uint8))
        bucket.launch(self.group, self.scale)
        self.launched = b + 1

    def _elsewhere(self) -> bool:
        """Whether something else averages the gradients: a sharded optimizer, local SGD."""
        return self.gradients_elsewhere or bool(self.local_sgd and not self.local_sgd.warming_up())

    @contextlib.contextmanager
    def averaged_once(self) -> Iterator[None]:
        """The backwards inside (a pipeline step's micro-batches) accumulate locally and count
        as one backward of the ``accumulate`` window; leaving averages their sum, one all-reduce
        per bucket, when the window ends. An exception inside leaves the gradients as they
        are: averaging then could wait on a rank that is not coming."""
        self.held = True
        try:
            yield
        finally:
            self.held = False
        ends = self.window_ends()
        self.backwards += 1
        if ends and self.world_size > 1 and self.started and not self._elsewhere():
            self.ready = bytearray(len(self.params))
            self._average()

    def _after_backward(self) -> None:
        self.in_backward = False
        if self.shares is not None:  # (before any wait: the rank's own compute time)
            self.shares.computed()
        if self.held:
            return  # one of averaged_once's: it counts them as one, and averages at its end
        self.backwards += 1
        if self.syncing:
            self._average()

    def _average(self) -> None:
        """Launch the buckets not launched yet, wait for all, settle the unused parameters."""
        # Buckets with a parameter no gradient reached: launch them as they are, in order.
        for b in range(self.launched, len(self.buckets)):
            bucket = self.buckets[b]
            for j, i in enumerate(bucket.layout.indices):
                if not self.ready[i]:
                    if bucket.params[j].grad is None:
                        self.zeroed.add(i)
                    bucket.take(j, self.scale)
            self._launch(b)
        for bucket in self.buckets:
            bucket.wait()
        self._settle_unused()
        self._reset_window()

    def _settle_unused(self) -> None:
        """A parameter no rank used keeps the gradient it had: None stays None."""
        if not self.buckets:
            return
        used = self.buckets[-1].extra
        if bool((used > 0).all()):
            return
        for i in torch.nonzero(used == 0).flatten().tolist():
            if i in self.zeroed:
                self.params[i].grad = None

    def _reset_window(self) -> None:
        self.in_backward = False
        self.syncing = False
        self.used = bytearray(len(self.params))  # gradient seen since the last all-reduce
        self.ready = bytearray(len(self.params))  # gradient seen in this backward
        self.zeroed: set[int] = set()  # .grad was None and is now a zeroed view
        self.pending = [len(b.params) for b in self.buckets]
        self.launched = 0  # buckets launched so far, in order


def broadcast(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with group rank 0's, one collective per dtype and device."""
    if not tensors:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    members = [local(t).detach() for t in tensors]  # a DTensor: its shard
    with torch.no_grad():
        for flat in fused.plan(members):  # the same flat buffers as fused_allreduce
            buf = fused.pack_torch(members, flat)
            dist.broadcast(buf, src=src, group=group)
            fused.unpack_torch(buf, members, flat)
            fused.release(buf, flat)


class BufferBroadcast:
    """Rank 0's buffers to every rank before each training forward, in one broadcast.

    Buffers of every dtype (BatchNorm's float statistics and its int64
    ``num_batches_tracked``) are copied as bytes into one flat uint8 buffer per
    device: a broadcast moves bytes and does no arithmetic, so the result is rank
    0's values bit for bit, as DDP's, in one collective instead of one per dtype.
    The flat buffer and the byte views are kept while the buffers stay the same
    tensors (checked by identity each time).
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group  # (ranks read at the first broadcast: none at world size 1)
        self.key: tuple[int, ...] = ()
        self.flats: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        if not all(t.is_contiguous() for t in tensors):
            broadcast(tensors, self.group)  # no byte view of a strided tensor: per dtype
            return
        key = tuple(id(t) for t in tensors)
        if key != self.key:
            self._plan(tensors)
            self.key = key
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        root = groups.rank(self.group) == 0
        with torch.no_grad():
            for flat, views, slots in self.flats:
                if root:
                    torch._foreach_copy_(slots, views)
                dist.broadcast(flat, src=src, group=self.group)
                if not root:
                    torch._foreach_copy_(views, slots)

    def _plan(self, tensors: list[torch.Tensor]) -> None:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t.detach().reshape(-1).view(torch.uint8))
        self.flats = []
        for device, views in by_device.items():
            flat = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8, device=device)
            slots, at = [], 0
            for v in views:
                slots.append(flat[at : at + v.numel()])
                at += v.numel()
            self.flats.append((flat, views, slots))


class SyncLink:
    """A parameter's link to the ``GradientSync`` that averages its gradient (weak: a parameter
    does not keep a dead model's averaging alive). The model registers it on each of its
    parameters, so that a sharded optimizer given those parameters finds the model's averaging
    (and takes the gradients over) without any table of its own. A copy of the parameter
    (``copy.deepcopy``) has none, and a pickled one comes back without it."""

    __slots__ = ("sync",)

    def __init__(self, sync: GradientSync):
        self.sync = weakref.ref(sync)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()


def syncs_of(params: Iterable[torch.Tensor]) -> list[GradientSync]:
    """The GradientSyncs averaging these parameters' gradients (their models'), each once."""
    found: list[GradientSync] = []
    for p in params:
        link = getattr(p, LINK, None)
        sync = link.sync() if isinstance(link, SyncLink) else None
        if sync is not None and all(sync is not s for s in found) and _holds(sync, p):
            found.append(sync)
    return found


def _holds(sync: GradientSync, param: torch.Tensor) -> bool:
    """Whether ``sync`` still averages ``param`` (a parameter it replanned without keeps its
    link to it until a newer averaging registers)."""
    return id(param) in sync.param_ids


def gradient_sync(model: nn.Module) -> GradientSync:
    """The ``GradientSync`` of a ``@data_parallel`` model (to inspect its buckets, say)."""
    for value in vars(model).values():
        if isinstance(value, GradientSync):
            return value
    raise ValueError(f"{type(model).__name__} is not a @data_parallel model")


def shard(model: nn.Module, batch: Any) -> Any:
    """``mg.shard(model, batch)``: this rank's rows of the global batch under the model's
    ``dp_shares``; the batch whole when nothing averages the model's gradients (serial)."""
    syncs = syncs_of(list(model.parameters()))
    if not syncs:
        return batch
    if len(syncs) > 1:
        raise RuntimeError("mg.shard: the model holds several data-parallel models; shard by one")
    return syncs[0].shard(batch)


# -- local SGD's model-level calls (here: they find the model's GradientSync) ----------
def outer_states(model: torch.nn.Module) -> list[LocalSGD]:
    """The model's local SGD with an outer optimizer (whose state a checkpoint holds)."""
    found = (s.local_sgd for s in syncs_of(list(model.parameters())))
    return [local for local in found if local is not None and local.outer is not None]


def flush(model: torch.nn.Module) -> None:
    """Apply a ``@data_parallel(overlap=True)`` model's round in flight: call it after the last
    step, so that the model holds every round (and every rank the same outer point)."""
    local = gradient_sync(model).local_sgd
    if local is not None:
        local.flush()
