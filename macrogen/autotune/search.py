"""Which candidates to measure, in which order, and when to stop.

- **Exhaustive** when the space has at most ``max_trials`` candidates: every
  one is measured (the all-defaults candidate first), so the winner is the
  true best of what was measured.
- **Random search with early stopping** otherwise: the default first, then
  candidates in a seeded random order (the seed comes from the source, so a
  resumed or repeated run walks the same order and reuses every measurement);
  it stops after ``max_trials`` candidates, or after ``patience`` candidates
  in a row that did not beat the best by more than ``min_improvement``.

Why not successive halving: it saves time by looking at many candidates
briefly and promising ones longer, but here a look is a whole training step
on real ranks whose cost is dominated by per-candidate set-up (building the
model and its buckets, compiling kernels, warming up), not by the number of
timed steps, so short looks buy little. Random search keeps each candidate a
single, complete, persisted measurement -- which is what makes a killed run
resume exactly where it stopped -- and with few tunables per file (a handful
of choices each) most spaces are small enough to be exhaustive anyway.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from macrogen.autotune.space import Space


@dataclass
class Search:
    order: list[dict[str, Any]]  # candidates to look at, in order
    strategy: str  # "exhaustive" or "random"
    patience: int | None  # None: no early stopping
    min_improvement: float = 0.01  # a new best must be this much faster to reset patience
    best: float | None = None
    since_best: int = 0
    seen: list[float | None] = field(default_factory=list)

    def observe(self, time_s: float | None) -> None:
        """One candidate's result (None: it failed)."""
        self.seen.append(time_s)
        if time_s is not None and (
            self.best is None or time_s < self.best * (1 - self.min_improvement)
        ):
            self.best = time_s
            self.since_best = 0
        else:
            self.since_best += 1
        if time_s is not None and self.best is not None:
            self.best = min(self.best, time_s)

    @property
    def done(self) -> bool:
        if len(self.seen) >= len(self.order):
            return True
        return self.patience is not None and self.since_best >= self.patience

    @property
    def stop_reason(self) -> str:
        if len(self.seen) >= len(self.order):
            return "complete" if self.strategy == "exhaustive" else "max trials"
        return "early stop" if self.done else "incomplete"


def plan(space: Space, *, max_trials: int, seed: int, patience: int | None = None) -> Search:
    candidates = list(space.candidates)
    if len(candidates) <= max_trials:
        return Search(candidates, "exhaustive", None)
    first, rest = candidates[0], candidates[1:]
    order = [first, *random.Random(seed).sample(rest, max_trials - 1)]
    return Search(order, "random", patience if patience is not None else max(4, max_trials // 4))
