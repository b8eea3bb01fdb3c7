"""What a tuning run shows when its output is a pipe or a file, and when nothing was measured."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from rich.table import Table

from macrogen.autotune import report, space
from macrogen.autotune.tuner import Outcome


def _outcome(stopped: str, record: dict | None) -> Outcome:
    params = (space.Parameter("X", 1, (1, 2), None, None),)
    cspace = space.build(params, space.TuningEnv("cpu", 1, "cpu"))
    return Outcome(Path("t.json"), record, "exhaustive", stopped, 2, 0, None, cspace, frozenset())


def test_progress_is_one_line_per_candidate_when_stderr_is_no_terminal():
    lines = io.StringIO()
    reporter = report.Reporter(Console(file=io.StringIO()), Console(file=lines))
    with reporter.progress(2) as progress:
        progress.advance({"values": {"X": 1}, "time_s": 0.012}, cached=False, best=0.012)
        progress.advance({"values": {"X": 2}, "error": "boom"}, cached=False, best=0.012)
    shown = lines.getvalue().splitlines()
    assert len(shown) == 2  # rich's bar redraws in place: a pipe saw nothing until the end
    assert shown[0].startswith("autotune 1/2") and "measured X=1 12.000 ms" in shown[0]
    assert "failed X=2" in shown[1]


def test_tables_keep_their_cells_when_piped():
    piped = report.wide(Console(file=io.StringIO()))
    table = Table()
    for name in ("layout", "predicted / step (fitted)", "measured peak (max rank)", "result"):
        table.add_column(name)
    table.add_row("tp2 x pp2 (mb4) x dp2 (replicate) + recompute 1/2", "1.0 ms", "8.5 MB", "")
    piped.print(table)
    text = piped.file.getvalue()
    assert "tp2 x pp2 (mb4) x dp2 (replicate) + recompute 1/2" in text and "…" not in text
    narrow = Console(file=io.StringIO(), width=80)  # what rich gave a pipe before: cut cells
    narrow.print(table)
    assert "tp2 x pp2 (mb4) x dp2 (replicate) + recompute 1/2" not in narrow.file.getvalue()


def test_a_budget_spent_before_any_measurement_says_so():
    out = io.StringIO()
    reporter = report.Reporter(Console(file=out, width=200), Console(file=io.StringIO()))
    reporter.summary(_outcome("budget", None), 1.0)
    assert "the budget ran out before the first measurement" in out.getvalue()
    out.truncate(0)
    failed = {"candidates": [{"values": {"X": 1}, "error": "boom"}], "key": {}}
    reporter.summary(_outcome("complete", failed), 1.0)
    assert "every candidate failed" in out.getvalue()
