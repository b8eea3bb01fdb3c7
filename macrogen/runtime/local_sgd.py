"""Local SGD for ``@data_parallel(sync_every=k)``: periodic averaging, an outer optimizer, overlap.

Ranks step on their own gradients, with no gradient communication, and every
k-th optimizer step they synchronize. The schedule is torch's
``PeriodicModelAverager(period=k, warmup_steps=n)``: for the first ``n``
optimizer steps gradients are averaged as usual (fully synchronous, like
``PostLocalSGDOptimizer``'s ``start_localSGD_iter``); from step ``n`` on, the
ranks synchronize after steps n, n+k, n+2k, ... (0-based).

How they synchronize (docs/async.md):

- ``outer=None``: the parameters are averaged (one all-reduce per dtype and device).
- ``outer=outer_sgd(lr, momentum, nesterov)`` (DiLoCo): the delta since the last
  synchronization, ``synced - params``, is averaged over the group and taken as
  the gradient of an outer SGD step from the last synchronized parameters
  (``synced``); every rank then continues from the result. lr 1 without
  momentum is plain averaging.
- ``overlap=True``: the delta's all-reduce starts at step s and is waited for at
  step s + ``delay``; the ranks meanwhile take ``delay`` more local steps, which
  are kept on top of the outer step's result (``params += new - sent``) and go
  into the next round's delta. So an outer step lands ``delay`` inner steps late,
  and ``delay <= k`` bounds the staleness: at most one round is in flight.
  ``delay=0`` waits at once and equals ``overlap=False`` bit for bit.

k > 1 changes the optimization: between synchronizations the ranks' models drift
apart, and the average of k local steps is not k steps on the averaged
gradient. With k == 1, plain averaging and plain SGD it equals the serial program.

The synchronization runs right after ``optimizer.step()`` of any optimizer that
holds the model's parameters: torch's global optimizer step hooks tell us when,
so the training loop does not change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from macrogen.runtime import fused

if TYPE_CHECKING:
    from macrogen.runtime.data_parallel import GradientSync


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer of ``@data_parallel(outer=outer_sgd(...))``: torch's SGD update rule."""

    lr: float = 0.7  # DiLoCo's outer learning rate
    momentum: float = 0.9  # 0: no momentum buffer
    nesterov: bool = True  # Nesterov momentum, as torch.optim.SGD(nesterov=True)

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1 or (self.nesterov and not self.momentum):
            raise ValueError(
                f"outer_sgd needs lr > 0, 0 <= momentum < 1 (> 0 with nesterov): {self}"
            )


PLAIN = OuterSGD(lr=1.0, momentum=0.0, nesterov=False)  # the outer step that averages


@dataclass
class _Part:
    """One dtype and device of the parameters: the outer state and the round in flight."""

    flat: fused.FlatBuffer
    synced: torch.Tensor  # (numel,) the parameters after the last outer step, same on every rank
    momentum: torch.Tensor | None  # (numel,) the outer momentum buffer (zeros before the first)
    sent: torch.Tensor | None = None  # (numel,) this rank's parameters when the round started
    delta: torch.Tensor | None = None  # (numel,) synced - sent, summed then averaged over the group
    work: Any = None  # the all-reduce in flight (None: done, or a blocking one)
    averaged: bool = False  # delta divided by the group's size (the round can be applied)


class LocalSGD:
    """Counts the optimizer steps over a model's parameters and synchronizes them every k."""

    def __init__(self, sync: GradientSync):
        config = sync.config
        self.every = config.sync_every
        self.warmup = config.sync_warmup
        self.outer: OuterSGD | None = config.outer
        self.overlap: bool = config.overlap
        self.delay: int = config.delay if config.overlap else 0
        if self.overlap and not 0 <= self.delay <= self.every:
            raise ValueError(
                f"data_parallel at {sync.where}: delay={self.delay} must be between 0 and"
                f" sync_every={self.every} (one round in flight at a time)"
            )
        if self.overlap and self.outer is None:
            self.outer = PLAIN  # overlapped averaging: the delta form of the average
        self.steps = 0  # optimizer steps over this model's parameters so far
        self.averages = 0  # synchronizations started so far
        self.due = -1  # the step after which the round in flight is applied (-1: none)
        self.parts: list[_Part] | None = None  # the outer state, from the first local step on
        self._plan = 0  # the GradientSync plan the outer state was laid out for
        self._sync = weakref.ref(sync)
        self._holds: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        if sync.world_size > 1:
            # one hook per model; a dead model's hook does nothing (it holds a weak reference)
            register_optimizer_step_post_hook(_after_step(weakref.ref(self)))
            if self.outer is not None:
                register_optimizer_step_pre_hook(_before_step(weakref.ref(self)))

    def warming_up(self) -> bool:
        """Still in the fully synchronous warm-up: gradients are averaged as usual."""
        return self.steps < self.warmup

    def _ours(self, optimizer: torch.optim.Optimizer) -> GradientSync | None:
        sync = self._sync()
        if sync is None or not sync.started or not self._holds_params(optimizer, sync):
            return None
        return sync

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The first local step starts from parameters every rank agrees on (the start-up
        # broadcast, or the synchronous warm-up): the outer optimizer's first point.
        sync = self._ours(optimizer)
        if sync is not None and self.parts is None and not self.warming_up():
            self.parts = self._snapshot(sync)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        sync = self._ours(optimizer)
        if sync is None:
            return
        if self.parts is not None:
            self._check_layout(sync)
        s = self.steps
        self.steps += 1
        if s == self.due:
            self._apply(sync)
        if s >= self.warmup and (s - self.warmup) % self.every == 0:
            self.averages += 1
            if self.outer is None:
                average(sync.params, sync.group, sync.world_size)
                return
            self._send(sync)
            self.due = s + self.delay
            if self.delay == 0:
                self._apply(sync)

    # -- the outer step ----------------------------------------------------------
    def _check_layout(self, sync: GradientSync) -> None:
        """The outer state is flat copies of the parameters as they were laid out: a replaced
        parameter, or one moved to another device or dtype, no longer fits it."""
        first = self.parts[0] if self.parts else None
        p = sync.params[first.flat.members[0]] if first is not None else None
        if sync.plan_id != self._plan or (
            p is not None
            and first is not None
            and (p.device, p.dtype) != (first.synced.device, first.synced.dtype)
        ):
            raise RuntimeError(
                f"data_parallel at {sync.where}: the model's parameters were replaced, moved or"
                " converted after local SGD's outer steps began; move the model before its first step"
            )

    def _snapshot(self, sync: GradientSync) -> list[_Part]:
        self._plan = sync.plan_id
        members = [p.detach() for p in sync.params]
        parts = []
        for flat in fused.plan(members):
            synced = _packed(members, flat)
            momentum = torch.zeros_like(synced) if self.outer and self.outer.momentum else None
            parts.append(_Part(flat, synced, momentum))
        return parts

    def _send(self, sync: GradientSync) -> None:
        """Start the round: each rank's delta since the last outer step, summed over the group."""
        assert self.parts is not None, "no outer state before a local step"
        members = [p.detach() for p in sync.params]
        with torch.no_grad():
            for part in self.parts:
                part.sent = _packed(members, part.flat)
                part.delta = part.synced - part.sent
                part.averaged = False
                part.work = dist.all_reduce(part.delta, group=sync.group, async_op=self.overlap)

    def settle(self) -> None:
        """Wait for the round in flight (if any) and average its delta; it is applied when due."""
        sync = self._sync()
        for part in self.parts or ():
            if part.delta is None or part.averaged or sync is None:
                continue
            if part.work is not None:
                part.work.wait()
                part.work = None
            part.delta.div_(sync.world_size)
            part.averaged = True

    def _apply(self, sync: GradientSync) -> None:
        """The outer SGD step from ``synced`` on the averaged delta; the local steps taken since
        the round started stay on top of it."""
        self.settle()
        outer = self.outer
        assert self.parts is not None and outer is not None
        members = [p.detach() for p in sync.params]
        lagged = self.steps - 1 != self.due - self.delay  # local steps taken since the send
        with torch.no_grad():
            for part in self.parts:
                assert part.delta is not None and part.sent is not None
                grad = part.delta
                if part.momentum is not None:  # torch.optim.SGD's rule, dampening 0
                    part.momentum.mul_(outer.momentum).add_(grad)
                    grad = (
                        grad.add(part.momentum, alpha=outer.momentum)
                        if outer.nesterov
                        else part.momentum
                    )
                part.synced.add_(grad, alpha=-outer.lr)
                if lagged:
                    now = _packed(members, part.flat)
                    fused.unpack_torch(now.sub_(part.sent).add_(part.synced), members, part.flat)
                else:
                    fused.unpack_torch(part.synced, members, part.flat)
                part.sent = part.delta = None
        self.due = -1

    def flush(self) -> None:
        """Apply the round in flight now (the end of the run): the model then holds every round."""
        sync = self._sync()
        if sync is not None and self.due >= 0:
            self._apply(sync)

    # -- checkpoints (runtime/checkpoint_state.py) --------------------------------
    def state_dict(self, *, load: bool = False) -> dict[str, torch.Tensor]:
        """The outer state as flat tensors, the same keys whether or not it exists yet.

        Saving waits for the round in flight (a checkpoint is one of the two places the
        overlapped form waits for the network); the round stays due at its step. ``load``:
        buffers for a checkpoint to be read into (then ``load_state_dict``). ``sent`` is
        this rank's; a checkpoint holds one rank's copy, as of the parameters themselves.
        """
        sync = self._sync()
        assert sync is not None
        if not load:
            self.settle()
        has = self.parts is not None
        parts = self.parts if self.parts is not None else self._snapshot(sync)
        out = {"counters": torch.tensor([self.steps, self.averages, self.due, int(has)])}
        for i, part in enumerate(parts):
            out[f"synced.{i}"] = part.synced
            if part.momentum is not None:
                out[f"momentum.{i}"] = part.momentum
            zeros = torch.zeros_like(part.synced)
            out[f"sent.{i}"] = part.sent if part.sent is not None and not load else zeros
            out[f"delta.{i}"] = part.delta if part.delta is not None and not load else zeros.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        sync = self._sync()
        assert sync is not None
        self.steps, self.averages, self.due, has = (int(v) for v in state["counters"].tolist())
        if not has:
            self.parts = None
            return
        parts = self._snapshot(sync)
        for i, part in enumerate(parts):
            part.synced = state[f"synced.{i}"].to(part.synced)
            if part.momentum is not None:
                part.momentum = state[f"momentum.{i}"].to(part.momentum)
            if self.due >= 0:  # a round in flight when saved: its averaged delta, applied when due
                part.sent = state[f"sent.{i}"].to(part.synced)
                part.delta = state[f"delta.{i}"].to(part.synced)
                part.averaged = True
        self.parts = parts

    def _holds_params(self, optimizer: torch.optim.Optimizer, sync: GradientSync) -> bool:
        holds = self._holds.get(optimizer)
        if holds is None:
            ours = {id(p) for p in sync.params}
            holds = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
            self._holds[optimizer] = holds
        return holds


def _packed(members: list[torch.Tensor], flat: fused.FlatBuffer) -> torch.Tensor:
    """A new flat copy of the members (pack_torch returns a single member itself)."""
    buf = fused.pack_torch(members, flat)
    return buf.clone() if len(flat.members) == 1 else buf


def _after_step(ref: weakref.ref[LocalSGD]) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        local = ref()
        if local is not None:
            local.after_step(optimizer)

    return hook


def _before_step(ref: weakref.ref[LocalSGD]) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        local = ref()
        if local is not None:
            local.before_step(optimizer)

    return hook


def average(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, world: int) -> None:
    """Replace ``params`` by their mean over ``group``: one all-reduce per dtype and device."""
    members = [p.detach() for p in params]
    with torch.no_grad():
        for flat in fused.plan(members):
            buf = fused.pack_torch(members, flat)
            dist.all_reduce(buf, group=group)
            buf.div_(world)
            fused.unpack_torch(buf, members, flat)
            fused.release(buf, flat)
