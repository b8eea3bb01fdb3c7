"""Periodic parameter averaging (local SGD) for ``@data_parallel(sync_every=k)``.

Ranks step on their own gradients, with no gradient communication, and every
k-th optimizer step their parameters are averaged (one all-reduce per dtype and
device). The schedule is torch's ``PeriodicModelAverager(period=k,
warmup_steps=n)``: for the first ``n`` optimizer steps gradients are averaged
as usual (fully synchronous, like ``PostLocalSGDOptimizer``'s
``start_localSGD_iter``); from step ``n`` on, parameters are averaged after
steps n, n+k, n+2k, ... (0-based).

k > 1 changes the optimization: between averages the ranks' models drift
apart, and the average of k local steps is not k steps on the averaged
gradient. With k == 1 and plain SGD it equals the serial program.

The averaging runs right after ``optimizer.step()`` of any optimizer that holds
the model's parameters: torch's global optimizer step hook tells us when,
so the training loop does not change.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from macrogen.runtime import fused

if TYPE_CHECKING:
    from macrogen.runtime.data_parallel import GradientSync


class LocalSGD:
    """Counts the optimizer steps over a model's parameters and averages them every k."""

    def __init__(self, sync: GradientSync):
        self.every = sync.config.sync_every
        self.warmup = sync.config.sync_warmup
        self.steps = 0  # optimizer steps over this model's parameters so far
        self.averages = 0  # parameter averages so far
        self._sync = weakref.ref(sync)
        self._holds: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        if sync.world_size > 1:
            # one hook per model; a dead model's hook does nothing (it holds a weak reference)
            register_optimizer_step_post_hook(_after_step(weakref.ref(self)))

    def warming_up(self) -> bool:
        """Still in the fully synchronous warm-up: gradients are averaged as usual."""
        return self.steps < self.warmup

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        sync = self._sync()
        if sync is None or not sync.started or not self._holds_params(optimizer, sync):
            return
        s = self.steps
        self.steps += 1
        if s >= self.warmup and (s - self.warmup) % self.every == 0:
            average(sync.params, sync.group, sync.world_size)
            self.averages += 1

    def _holds_params(self, optimizer: torch.optim.Optimizer, sync: GradientSync) -> bool:
        holds = self._holds.get(optimizer)
        if holds is None:
            ours = {id(p) for p in sync.params}
            holds = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
            self._holds[optimizer] = holds
        return holds


def _after_step(ref: weakref.ref[LocalSGD]):
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        local = ref()
        if local is not None:
            local.after_step(optimizer)

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
