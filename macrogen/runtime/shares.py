"""Uneven data-parallel shares: each rank's rows of the global batch, from its speed.

Every rank loads the same global batch (the serial program's), and
``mg.shard(model, batch)`` hands each data rank its own contiguous slice of
its rows: rank r gets ``rows[r]`` rows, starting after ranks 0..r-1's. The
split is computed on every rank from the same numbers, so all agree: no row
is dropped or seen twice.

The update equals the serial one on the whole global batch when the loss is a
mean over the batch rows (torch's ``reduction="mean"``): the serial gradient is
``sum_r rows[r]/total * g_r``, where ``g_r`` is rank r's gradient of the mean
loss of its rows. So each rank's gradient is weighted by ``rows[r] / total``
before the sum (``weight``), instead of the even ``1 / world``. Rows, not ranks,
are averaged. Other losses are not equal to serial under uneven shares: a sum
over rows, or a mean over tokens where rows hold different numbers of counted
tokens (padding, ``ignore_index``); give those a mean over rows.

``shares="measured"``: the split is proportional to each rank's measured rows
per second over the last ``rebalance_every`` steps (the time from its
``mg.shard`` call to the end of its backward: compute, not the wait for the
others), all-gathered every ``rebalance_every`` steps (one collective of one
number per rank), so a rank that slows down mid-run gets fewer rows.
``shares=(3, 1)``: fixed proportions; ``"even"``: as even as the rows allow.
``max_rows``: a cap on each rank's rows (its memory); the shares obey it, the
rows it takes off a rank going to the others in proportion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MODES = ("even", "measured")


def split_rows(total: int, weights: Sequence[float], caps: Sequence[int | None]) -> list[int]:
    """``total`` rows cut in proportion to ``weights``, each rank at most its cap, at least one.

    Ranks whose proportional share exceeds their cap get the cap; the rest is cut again
    among the others (water-filling). Rounding: floors, then the leftover rows one each
    to the largest remainders (ties: the lower rank). The same inputs give the same
    rows on every rank."""
    n = len(weights)
    if total < n:
        raise ValueError(f"a global batch of {total} rows cannot give each of {n} ranks a row")
    limit = [total if c is None else c for c in caps]
    if sum(limit) < total:
        raise ValueError(
            f"the ranks' max_rows {list(caps)} hold {sum(limit)} rows, fewer than the global"
            f" batch of {total}"
        )
    ideal = [0.0] * n
    capped: set[int] = set()
    while True:
        free = [r for r in range(n) if r not in capped]
        left = total - sum(limit[r] for r in capped)
        mass = sum(weights[r] for r in free)
        over = False
        for r in free:
            ideal[r] = left * weights[r] / mass if mass > 0 else left / len(free)
            if ideal[r] > limit[r]:
                capped.add(r)
                over = True
        if not over:
            break
    for r in capped:
        ideal[r] = float(limit[r])
    rows = [math.floor(x) for x in ideal]
    order = sorted(range(n), key=lambda r: (-(ideal[r] - rows[r]), r))
    extra = total - sum(rows)
    for r in order:
        if extra == 0:
            break
        if rows[r] < limit[r]:
            rows[r] += 1
            extra -= 1
    # a rank with no row would take a mean over nothing: one row from the fullest rank
    for r in range(n):
        if rows[r] == 0:
            donor = max(range(n), key=lambda d: (rows[d], -d))
            rows[donor] -= 1
            rows[r] = 1
    return rows


def split_gain(
    rates: Sequence[float],
    total: int,
    caps: Sequence[int | None] | None = None,
    fixed_s: float = 0.0,
) -> tuple[float, float]:
    """Predicted seconds of one step of ``total`` rows over ranks computing ``rates`` rows per
    second, (even split, split in proportion to the rates): a step lasts as long as its
    slowest rank, plus ``fixed_s`` that every rank pays (its collectives, its optimizer step).
    ``macrogen plan``'s rule for data ranks of different speeds, on this split's rows."""
    n = len(rates)
    caps = caps if caps is not None else [None] * n
    even = split_rows(total, [1.0] * n, caps)
    uneven = split_rows(total, list(rates), caps)
    return (
        max(r / v for r, v in zip(even, rates)) + fixed_s,
        max(r / v for r, v in zip(uneven, rates)) + fixed_s,
    )


def slice_rows(batch: Any, lo: int, hi: int) -> Any:
    """``batch`` (a tensor, or a tuple / list / dict of them) with rows ``lo:hi`` of each
    tensor; anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, tuple):
        parts = [slice_rows(b, lo, hi) for b in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else tuple(parts)
    if isinstance(batch, list):
        return [slice_rows(b, lo, hi) for b in batch]
    if isinstance(batch, dict):
        return {k: slice_rows(v, lo, hi) for k, v in batch.items()}
    return batch


def count_rows(batch: Any, where: str) -> int:
    """The rows of the batch's tensors (the first dim; every tensor must have the same)."""
    found: set[int] = set()

    def visit(b: Any) -> None:
        if isinstance(b, torch.Tensor):
            if b.dim() == 0:
                raise ValueError(f"{where}: mg.shard takes tensors with a batch dim, not a scalar")
            found.add(b.shape[0])
        elif isinstance(b, (tuple, list)):
            for x in b:
                visit(x)
        elif isinstance(b, dict):
            for x in b.values():
                visit(x)

    visit(batch)
    if len(found) != 1:
        what = "no tensor" if not found else f"tensors of {sorted(found)} rows"
        raise ValueError(f"{where}: mg.shard needs tensors of one batch size, and got {what}")
    return found.pop()


@dataclass(frozen=True)
class ShareConfig:
    shares: str | tuple[float, ...]  # "even", "measured" or fixed proportions, one per data rank
    rebalance_every: int = 10  # "measured": steps between two measurements' all-gather
    max_rows: int | tuple[int, ...] | None = None  # each rank's cap in rows (its memory)


class Shares:
    """One data-parallel model's split of each global batch over its data ranks."""

    def __init__(
        self, config: ShareConfig, group: dist.ProcessGroup | None, size: int, rank: int, where: str
    ):
        self.config = config
        self.group = group
        self.size, self.rank, self.where = size, rank, where
        self.measured = config.shares == "measured"
        if isinstance(config.shares, str):
            if config.shares not in MODES:
                raise ValueError(f"{where}: dp_shares={config.shares!r}: expected one of {MODES}")
            self.weights = [1.0] * size
        else:
            given = [float(w) for w in config.shares]
            if len(given) != size or not all(w > 0 for w in given):
                raise ValueError(
                    f"{where}: dp_shares={list(config.shares)} gives {len(given)} shares for"
                    f" {size} data ranks: one positive number per data rank"
                )
            self.weights = given
        caps = config.max_rows
        self.caps: list[int | None] = (
            [None] * size
            if caps is None
            else [caps] * size
            if isinstance(caps, int)
            else list(caps)
        )
        if len(self.caps) != size:
            raise ValueError(
                f"{where}: dp_max_rows={list(self.caps)} has {len(self.caps)} caps for {size}"
                " data ranks: one int, or one per data rank"
            )
        self.steps = 0  # global batches split so far
        self.rows: list[int] = []  # the last split: rows per data rank
        self.weight = 1.0 / size  # this rank's gradient weight in the sum (rows / total)
        self.taken = False  # a batch was split since the last backward ended
        self.started: float | None = None  # when this rank's rows were handed out
        self.window_rows = 0  # rows computed since the last measurement
        self.window_seconds = 0.0  # and the seconds they took (forward and backward)
        self.history: list[tuple[int, list[float]]] = []  # (step, weights) at each rebalance
        self.total_seconds = 0.0  # this rank's compute seconds since the start
        self.gain = 1.0  # the last rebalance's predicted step speed-up over the even split

    def take(self, batch: Any, device: torch.device) -> Any:
        """This rank's rows of the global ``batch``; re-measures first every N steps."""
        total = count_rows(batch, self.where)
        every = self.config.rebalance_every
        if self.measured and self.steps and self.steps % every == 0:
            self.rebalance(self.gather_rates(device))
        try:
            self.rows = split_rows(total, self.weights, self.caps)
        except ValueError as e:
            raise ValueError(f"{self.where}: dp_shares: {e}") from None
        lo = sum(self.rows[: self.rank])
        hi = lo + self.rows[self.rank]
        self.weight = self.rows[self.rank] / total
        self.steps += 1
        self.taken = True
        self.started = time.perf_counter()
        return slice_rows(batch, lo, hi)

    def computed(self) -> None:
        """This rank's backward ended: its rows took the time since ``take``."""
        self.taken = False
        if self.started is None:
            return
        seconds = time.perf_counter() - self.started
        self.window_seconds += seconds
        self.window_rows += self.rows[self.rank]
        self.total_seconds += seconds
        self.started = None

    def rate(self) -> float:
        """Rows per second over the window (0: nothing measured yet)."""
        return self.window_rows / self.window_seconds if self.window_seconds > 0 else 0.0

    def gather_rates(self, device: torch.device) -> list[float]:
        """Every data rank's rate, in rank order (one all-gather of one number each)."""
        local = torch.tensor([self.rate()], dtype=torch.float64, device=device)
        every = [torch.zeros_like(local) for _ in range(self.size)]
        dist.all_gather(every, local, group=self.group)
        return [float(t.item()) for t in every]

    def rebalance(self, rates: Sequence[float]) -> None:
        """New weights from every rank's rate (the same list on every rank); a window in which
        some rank measured nothing keeps the weights as they are."""
        self.window_rows, self.window_seconds = 0, 0.0
        if len(rates) != self.size or not all(r > 0 and math.isfinite(r) for r in rates):
            return
        mass = sum(rates)
        self.weights = [r / mass for r in rates]
        if self.rows:
            even, uneven = split_gain(rates, sum(self.rows), self.caps)
            self.gain = even / uneven
        self.history.append((self.steps, list(self.weights)))
