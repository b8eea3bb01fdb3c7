"""The layout search's finals: the leaders timed again side by side, in turns, until one is
faster than each other in more turns than chance gives.

A candidate's runs are its first measurement (the search's) and the repeats the finals add
(``times`` in its record), each repeat with the turn it was timed in (``turns``). In a turn
every finalist is timed once, back to back in one launch, so that a change of load (another
job starting, a spike) hits them alike: the finals compare the finalists turn by turn (paired),
not by medians of separately noisy runs. The winner is faster than every other finalist in
the majority of the turns they share; it is decided when, against each, it was faster in so
many of them that a coin tossed per turn would give as many in under ``ALPHA`` of cases (3 of
3, 6 of 7, 7 of 9). Everything here reads the database through the book (``tuner._Book``), so
a rerun over the same records decides the same and measures nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from macrogen.autotune.tuner import _Book

# layouts: the measured layouts within CLOSE of the best median (the runner-up always,
# FINALISTS at most) are timed in turns until each has MIN_RUNS runs (its first and
# MIN_RUNS - 1 turns), then one turn more at a time (up to MAX_RUNS runs) until the winner
# is decided: on a loaded machine (one job beside 2 ranks on 2 cores) runs of one layout land
# 50-130% apart, and 5 runs each left an 18% lead a tie; the search goes on while a layout
# not measured is predicted within the winner's spread of it
# (CLOSE is wide: under that load a layout's first run may land 50% above its median, and
# with two others close to each other a spiked best was left out at 10%)
FINALISTS, CLOSE, MIN_RUNS, MAX_RUNS = 3, 0.5, 4, 9
ALPHA = 0.125  # a lead is taken when a coin per turn would give it at most this often


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


def turns_of(known: Mapping[str, Any] | None) -> dict[int, float]:
    """A candidate's repeats by the turn they were timed in."""
    if known is None:
        return {}
    times, turns = known.get("times") or [], known.get("turns") or []
    return {int(k): float(t) for k, t in zip(turns, times) if k is not None}


def spread(runs: list[float]) -> float:
    """Half the range of a candidate's runs: how far one run of it may land from another."""
    return (max(runs) - min(runs)) / 2 if len(runs) > 1 else 0.0


def needed(turns: int) -> int | None:
    """The fewest of ``turns`` a finalist must win to lead beyond chance (None: no number
    can: a coin wins all of 2 turns in a quarter of cases)."""
    for wins in range(turns // 2 + 1, turns + 1):
        tail = sum(math.comb(turns, k) for k in range(wins, turns + 1)) / 2**turns
        if tail <= ALPHA:
            return wins
    return None


def leaders(
    order: list[dict[str, Any]], book: _Book, favourite: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The measured layouts within CLOSE of the best median, and the runner-up whatever its
    distance, best first (FINALISTS at most), and the measured layout the fitted model
    predicts fastest (``favourite``) beside them: a model and a single run that disagree
    are settled by more runs; none when fewer than two were measured."""
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
    chosen = (close if len(close) > 1 else [timed[0][2], timed[1][2]])[:FINALISTS]
    measured = [c for _, _, c in timed]
    if favourite is not None and favourite in measured and favourite not in chosen:
        chosen.append(favourite)
    return chosen


def _wins(a: dict[int, float], b: dict[int, float]) -> tuple[int, int]:
    """The turns in which ``a`` was faster than ``b``, of those both were timed in."""
    shared = a.keys() & b.keys()
    return sum(a[k] < b[k] for k in shared), len(shared)


def standing(finalists: list[dict[str, Any]], book: _Book) -> tuple[int, bool]:
    """The winner's index in ``finalists`` and whether it is decided.

    The winner beats the most others in the majority of the turns they share (ties: the lower
    median of all runs, then the earlier finalist); it is decided when it beat each other in
    at least ``needed`` of their shared turns, and shares MIN_RUNS - 1 turns with each."""
    turns = [turns_of(book.known(c)) for c in finalists]
    medians = [statistics.median(runs_of(book.known(c)) or [math.inf]) for c in finalists]
    n = range(len(finalists))
    wins = [[_wins(turns[i], turns[j]) for j in n] for i in n]  # (i faster, shared) per j
    beaten = [sum(1 for j in n if j != i and 2 * wins[i][j][0] > wins[i][j][1]) for i in n]
    winner = min(n, key=lambda i: (-beaten[i], medians[i], i))
    decided = len(finalists) > 1
    for j in n:
        if j != winner:
            won, shared = wins[winner][j]
            need = needed(shared)
            decided = decided and shared >= MIN_RUNS - 1 and need is not None and won >= need
    return winner, decided


def next_round(finalists: list[dict[str, Any]], book: _Book) -> list[tuple[int, dict[str, Any]]]:
    """The finalists' next turns, as (turn, finalist) in the order to time them: each turn
    times every finalist once, starting one further along each turn (A B C, B C A: none is
    always first); up to MIN_RUNS runs each at once, then one turn at a time while the winner
    is not decided and has fewer than MAX_RUNS - 1 turns beside each other; [] when done."""
    if len(finalists) < 2:
        return []
    turns = [turns_of(book.known(c)) for c in finalists]
    winner, decided = standing(finalists, book)
    shared = min(_wins(turns[winner], t)[1] for i, t in enumerate(turns) if i != winner)
    if shared < MIN_RUNS - 1:
        count = MIN_RUNS - 1 - shared
    elif decided or shared >= MAX_RUNS - 1:
        return []
    else:
        count = 1
    first = _last_turn(book) + 1
    n = len(finalists)
    return [
        (turn, finalists[(turn + i) % n]) for turn in range(first, first + count) for i in range(n)
    ]


def _last_turn(book: _Book) -> int:
    """The latest turn in the record (0: none yet)."""
    record = book.record_ or {}
    return max(
        (k for c in record.get("candidates", []) for k in c.get("turns") or [] if k is not None),
        default=0,
    )


def winner(finalists: list[dict[str, Any]], book: _Book) -> dict[str, Any] | None:
    """The finals' winner (None: no finals)."""
    return finalists[standing(finalists, book)[0]] if len(finalists) > 1 else None


def settled(finalists: list[dict[str, Any]], book: _Book) -> tuple[float | None, float]:
    """The winner's median and its runs' spread relative to it (the finals' word on the noise)."""
    chosen = winner(finalists, book)
    runs = runs_of(book.known(chosen)) if chosen is not None else []
    if not runs:
        return None, 0.0
    median = statistics.median(runs)
    return median, spread(runs) / median if median else 0.0


def verdict(finalists: list[dict[str, Any]], book: _Book) -> str:
    """``faster than the runner-up in 6 of 7 turns side by side (x1.042, the median of their
    ratios), beyond chance``, or ``...: a tie``."""
    if len(finalists) < 2:
        return ""
    turns = [turns_of(book.known(c)) for c in finalists]
    w, decided = standing(finalists, book)

    def against(j: int) -> float:  # the share of its turns beside the winner that j won
        won, shared = _wins(turns[j], turns[w])
        return won / shared if shared else -1.0

    r = max((j for j in range(len(finalists)) if j != w), key=against)  # the runner-up
    won, shared = _wins(turns[w], turns[r])
    if not shared:
        return ""
    ratio = statistics.median(turns[r][k] / turns[w][k] for k in turns[w].keys() & turns[r].keys())
    said = (
        f"faster than the runner-up in {won} of {shared} turns side by side"
        f" (x{ratio:.3f}, the median of their ratios)"
    )
    return f"{said}, beyond chance" if decided else f"{said}: a tie"
