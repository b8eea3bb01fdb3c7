"""What a ``ShardedOptimizer`` watches between its steps, and the torch-function mode that does.

Two things happen out of sight of the training loop, and a ``TorchFunctionMode``
(the *guard*) sees every torch operation while either is under way:

- after ``step()``, the updated parameters are still arriving (each bucket's
  all-gather, the first layers' first): an operation that reads a parameter in
  flight first waits for its bucket, and those started before it. The next
  forward's first layers so run while later buckets arrive, and nothing reads
  a stale parameter: not the forward, not the user between ``step()`` and the
  forward (logging, an EMA, ``state_dict()``, ``torch.save``, ``no_grad``
  inference), not a second step;
- from the end of a training forward to ``step()`` / ``zero_grad()``, the
  backward's gradients have been sent: norms, scalar writes and a GradScaler's
  unscale of them go to their average (``zero_grads.SentGradients``).

The guard is pushed beneath any torch-function modes already on the stack (a
user's ``with torch.device(...)``), so their exit, which pops the top of the
stack, leaves it in place; it is taken off once nothing is watched and it is on
top. It costs about 10 us per torch operation while it is on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from macrogen.runtime.zero_grads import ROUTED, SentGradients

if TYPE_CHECKING:
    from macrogen.runtime.zero_buckets import ShardBucket

# The runtime's own tensor operations while the guard is on (during backward, in step()):
# without it, each would pay the guard's ~10 us (about 1 ms per step on bench/ddp.py's GPT).
UNWATCHED = torch._C.DisableTorchFunction


class Watch:
    """The parameters in flight after a step and the gradients sent before it, for one
    sharded optimizer; the guard is on the torch-function stack while either is there."""

    def __init__(self, sent: SentGradients):
        self.sent = sent
        self.in_flight: dict[int, int] = {}  # id(param) -> k: in the k-th bucket gathered
        self.gathers: list[ShardBucket] = []  # buckets in the order their all-gathers started
        self.done = 0  # all-gathers waited for and written
        self.gradients = False  # the sent gradients are watched (to step() / zero_grad())
        self.guard: _Guard | None = None

    # -- the updated parameters: waited for where they are read ------------------------------
    def start_gathers(self, buckets: list[ShardBucket], launch: Callable[[int], None]) -> None:
        """``launch(b)`` starts bucket b's all-gather; the last bucket (the forward's first
        layers) first. Every parameter is then in flight until it is read or finished."""
        self.gathers, self.done = [], 0
        for b in reversed(range(len(buckets))):
            launch(b)
            for p in buckets[b].params:  # (a position, so that the guard compares ints)
                self.in_flight[id(p)] = len(self.gathers)
            self.gathers.append(buckets[b])
        self._push()

    def finish(self) -> None:
        """Every parameter current now; the guard off the stack if nothing else is watched."""
        if self.done < len(self.gathers):
            self._finish_upto(len(self.gathers) - 1)
        self.drop()

    def _finish_upto(self, k: int) -> None:
        """Write the all-gathers started first, up to the k-th, into the parameters."""
        while self.done <= k:
            bucket = self.gathers[self.done]
            for p in bucket.params:  # first: the copy below is an operation on them
                self.in_flight.pop(id(p), None)
            self.done += 1
            bucket.finish_gather()

    def wait_for(self, args: Any, kwargs: dict[str, Any]) -> None:
        """Called by the guard on every torch operation: wait if it reads a parameter in flight."""
        flight = self.in_flight
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

    # -- the gradients sent ------------------------------------------------------------------
    def watch_gradients(self) -> None:
        """From a training forward's end to step() / zero_grad()."""
        self._push()
        self.gradients = True

    def unwatch_gradients(self) -> None:
        self.sent.clear()
        self.gradients = False

    # -- the guard on the stack --------------------------------------------------------------
    def _push(self) -> None:
        if self.guard is None:  # (one left on the stack under a user's mode serves again)
            self.guard = _Guard(self)
            _push_beneath_user_modes(self.guard)

    def drop(self) -> None:
        """Take the guard off the torch-function stack once nothing is watched."""
        guard = self.guard
        if guard is None or self.in_flight or self.gradients:
            return
        if guard.thread != threading.get_ident():
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is guard:
            torch._C._pop_torch_function_stack()
            self.guard = None


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
    """Sees every torch operation of the thread that pushed it (see the module docstring)."""

    def __init__(self, watch: Watch):
        super().__init__()
        self.watch = weakref.ref(watch)
        self.thread = threading.get_ident()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        watch = self.watch()
        if watch is not None:
            if watch.in_flight:
                watch.wait_for(args, kwargs)
            if watch.sent.grads and func in ROUTED:
                return watch.sent.route(func, args, kwargs)
        return func(*args, **kwargs)
