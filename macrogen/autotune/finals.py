"""The layout search's finals: the leaders timed again, in turns, until the winner's lead
exceeds the noise of their runs.

A candidate's runs are its first measurement (the search's) and the repeats the finals add
(``times`` in its record); it keeps their median. Everything here reads the database
through the book (``tuner._Book``), so a rerun over the same records decides the same and
measures nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from macrogen.autotune.tuner import _Book

# layouts: the measured layouts within CLOSE of the best median (the runner-up always,
# FINALISTS at most) are timed again in turns until each has MIN_RUNS runs, then in more rounds
# (up to MAX_RUNS runs each) until the winner's lead over the runner-up exceeds their measured
# spread: the winner is decided side by side, not by one measurement that a load spike made
# slow or a quiet moment fast; and the search goes on while a layout not measured is
# predicted within that spread of the winner
FINALISTS, CLOSE, MIN_RUNS, MAX_RUNS = 3, 0.10, 3, 5


def first_time(known: Mapping[str, Any]) -> float | None:
    """A candidate's first measurement (the search's), whatever the finals added since."""
    times = known.get("times")
    return times[0] if times else known.get("time_s")


def runs_of(known: Mapping[str, Any] | None) -> list[float]:
    """A candidate's measured times: its first, then the finals' repeats."""
    if known is None or "time_s" not in known:
        return []
    times = known.get("times")
    return [float(t) for t in times] if times else [float(known["time_s"])]


def spread(runs: list[float]) -> float:
    """Half the range of a candidate's runs: how far one run of it may land from another."""
    return (max(runs) - min(runs)) / 2 if len(runs) > 1 else 0.0


def leaders(order: list[dict[str, Any]], book: _Book) -> list[dict[str, Any]]:
    """The measured layouts within CLOSE of the best median, and the runner-up whatever its
    distance, best first (FINALISTS at most); none when fewer than two were measured."""
    timed = sorted(
        (
            (statistics.median(r), i, c)
            for i, c in enumerate(order)
            if (r := runs_of(book.known(c)))
        ),
        key=lambda x: (x[0], x[1]),
    )
    if len(timed) < 2:
        return []
    best = timed[0][0]
    close = [c for t, _, c in timed if t <= best * (1 + CLOSE)]
    return (close if len(close) > 1 else [timed[0][2], timed[1][2]])[:FINALISTS]


def next_round(finalists: list[dict[str, Any]], book: _Book) -> list[dict[str, Any]]:
    """The leaders' next runs, in turns (A B C A B C: drifting load hits each alike): the
    missing ones up to MIN_RUNS; then, while the winner's lead does not exceed the spread of
    its runs and the runner-up's, one more each up to MAX_RUNS; [] when decided."""
    runs = [runs_of(book.known(c)) for c in finalists]
    need = [max(0, MIN_RUNS - len(r)) for r in runs]
    if any(need):
        return [c for turn in range(max(need)) for c, n in zip(finalists, need) if n > turn]
    if not finalists or _separated(runs):
        return []
    return [c for c, r in zip(finalists, runs) if len(r) < MAX_RUNS]


def _separated(runs: list[list[float]]) -> bool:
    medians = sorted((statistics.median(r), i) for i, r in enumerate(runs))
    (first, i), (second, j) = medians[0], medians[1]
    return second - first > max(spread(runs[i]), spread(runs[j]))


def settled(finalists: list[dict[str, Any]], book: _Book) -> tuple[float | None, float]:
    """The winner's median and its runs' spread relative to it (the finals' word on the noise)."""
    runs = [r for c in finalists if (r := runs_of(book.known(c)))]
    if not runs:
        return None, 0.0
    best = min(runs, key=statistics.median)
    median = statistics.median(best)
    return median, spread(best) / median if median else 0.0


def verdict(finalists: list[dict[str, Any]], book: _Book) -> str:
    """``x1.042 ahead of the runner-up, beyond their spread (1.3%)``, or a tie within it."""
    runs = [runs_of(book.known(c)) for c in finalists]
    runs = [r for r in runs if r]
    if len(runs) < 2:
        return ""
    ranked = sorted(runs, key=statistics.median)
    first, second = statistics.median(ranked[0]), statistics.median(ranked[1])
    noise = max(spread(ranked[0]), spread(ranked[1])) / first
    lead = second / first
    if second - first > noise * first:
        return f"x{lead:.3f} ahead of the runner-up, beyond their spread ({noise:.1%})"
    return f"x{lead:.3f} ahead of the runner-up, within their spread ({noise:.1%}): a tie"
