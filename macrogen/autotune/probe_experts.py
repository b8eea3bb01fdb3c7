"""A mixture of experts' experts, measured in the serial probe: what ``ep`` changes.

The probe (``probe.py``) asks this module for the experts ``mg.parallelize(ep=)`` would deal
(stacked experts modules, and experts in an ``nn.ModuleList``: the runtime's own finders), and
while it times its steps this module's hooks measure:

- the experts' forward time (``Profile.expert_s`` is it x the step's backward ratio);
- the bytes routed per step, one way: every (token, slot) pair's hidden state, pairs x hidden x
  element size, summed over the MoE layers (``expert_routing.Traffic.dispatched`` counts the
  same on a rank of an expert group: ``routed_bytes`` below is the one formula);
- the experts' cost per call that does not shrink with their rows (Python, dispatch, a loop
  over experts, launches): each rank runs all E experts of a layer without ``ep``, E / ep with
  it. Timed alone, forward and backward, on the first call's rows and on fewer rows that still
  reach every expert it reached: t = fixed + pairs x per pair.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

# the experts' fixed cost is the median of this many rounds (as the blocks', probe.ROUNDS)
ROUNDS = 3


def routed_bytes(pairs: float, hidden: int, element_size: int) -> float:
    """The bytes of one routing all-to-all, one way: (token, slot) pairs, i.e. tokens x top_k,
    of ``hidden`` values each. Forward sends them to their experts and back (2x); backward
    the same again (4x in a step)."""
    return pairs * hidden * element_size


class ExpertsProbe:
    """The model's experts; ``hooks`` time them and count their routed bytes while installed."""

    def __init__(self, model: Any, clock: Any) -> None:
        from macrogen.runtime.expert_modules import expert_lists
        from macrogen.runtime.expert_parallel import experts_modules

        self.stacked = [m for _, m in experts_modules(model)]
        self.lists: list[Any] = [b._modules["experts"] for _, b in expert_lists(model)]
        counts = [m.__dict__["num_experts"] for m in self.stacked] + [len(x) for x in self.lists]
        self.experts = math.gcd(*counts) if counts else 0  # what ep must divide, every layer's
        self.layers = len(counts)
        params = {id(p): p for m in [*self.stacked, *self.lists] for p in m.parameters()}
        self.param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        self.clock = clock  # the experts' forward (probe._Clock)
        self.routed = 0.0  # bytes routed one way since ``reset``
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []  # the first layer's, for call_s
        self.first: set[int] = set()  # the first layer's experts modules (ids)
        self.recording = False

    def reset(self) -> None:
        """From the timed steps on: their time and bytes, and the first layer's calls."""
        self.clock.reset()
        self.routed = 0.0
        self.recording = True

    def hooks(self) -> list[Any]:
        first = {id(m) for m in (self.stacked[:1] or (self.lists[0] if self.lists else []))}
        handles = []
        for m in [*self.stacked, *(e for experts in self.lists for e in experts)]:
            handles.append(m.register_forward_pre_hook(self._before, with_kwargs=True))
            handles.append(m.register_forward_hook(self.clock.stop))
        self.first = first
        return handles

    def _before(self, module: Any, args: Any, kwargs: Any) -> None:
        self.clock.start()
        # stacked: (hidden, top_k_index, top_k_weights); a list's expert: (x,); by name or not
        args = (*args, *kwargs.values())
        if not args or not all(hasattr(a, "detach") for a in args):
            return  # a call the routing would not take: not counted
        hidden = args[0]
        pairs = args[1].numel() if len(args) > 2 else hidden.shape[:-1].numel()
        self.routed += routed_bytes(pairs, hidden.shape[-1], hidden.element_size())
        recorded = {id(m) for m, _ in self.calls}
        if self.recording and id(module) in self.first and id(module) not in recorded:
            self.calls.append((module, tuple(a.detach() for a in args)))

    def call_s(self, torch: Any, cuda: bool) -> float:
        """The experts' fixed cost per step, all layers (the first timed alone, x layers)."""
        if not self.calls:
            return 0.0
        rounds = []
        try:
            for _ in range(ROUNDS):
                rounds.append(sum(_fixed(m, args, torch, cuda) for m, args in self.calls))
        except Exception:  # experts that need their block around them: no estimate, no harm
            return 0.0
        return statistics.median(rounds) * self.layers


def _fixed(module: Any, args: tuple[Any, ...], torch: Any, cuda: bool) -> float:
    """One experts call's cost that its rows do not explain: stacked experts on fewer tokens
    that reach the same experts, an expert of a list on one row; t = fixed + pairs x per pair."""
    hidden = args[0]
    if len(args) > 2:  # stacked: (hidden, top_k_index, top_k_weights)
        index = args[1]
        pairs = index.numel()
        few = sorted({int(torch.nonzero(index == e)[0, 0]) for e in index.unique().tolist()})
        fewer = tuple(a[few] for a in args)
        less = fewer[1].numel()
    else:  # an expert of a list, on its rows
        pairs = hidden.shape[:-1].numel()
        fewer, less = (hidden.reshape(-1, hidden.shape[-1])[:1],), 1
    if pairs <= less:
        return _timed(module, args, torch, cuda)
    whole, part = _timed(module, args, torch, cuda), _timed(module, fewer, torch, cuda)
    per_pair = max(0.0, (whole - part) / (pairs - less))
    return float(max(0.0, min(part, part - per_pair * less)))


def _timed(module: Any, args: tuple[Any, ...], torch: Any, cuda: bool, calls: int = 5) -> float:
    """Forward + backward of ``module`` alone, the median of ``calls`` (one warm-up first)."""
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:  # backward would add to the step's gradients in place
        p.grad = None
    try:
        times = []
        for i in range(calls + 1):
            inputs = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
            start = time.perf_counter()
            module(*inputs).float().sum().backward()
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        for p, g in grads:  # the timing's gradients are not the step's
            p.grad = g
