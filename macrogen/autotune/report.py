"""What a tuning run shows: a rich progress bar while it runs, a table of candidates at the end."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from macrogen.autotune import database

if TYPE_CHECKING:
    from macrogen.autotune.tuner import Outcome


def format_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


class _Bar:
    def __init__(self, progress: Progress, task: Any):
        self.progress, self.task = progress, task

    def advance(self, candidate: Mapping[str, Any], *, cached: bool, best: float | None) -> None:
        values = database.decode_values(candidate.get("values", {}))
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        how = "cached" if cached else ("failed" if "error" in candidate else "measured")
        self.progress.update(
            self.task,
            advance=1,
            description=escape(f"{how} {shown}; best {format_time(best)}"),
        )


class _Lines:
    """Progress as one line per candidate: what a pipe or a log file can show (rich's bar
    redraws itself in place, which only a terminal shows while it runs)."""

    def __init__(self, console: Console, total: int):
        self.console, self.total, self.done = console, total, 0
        self.started = time.monotonic()

    def advance(self, candidate: Mapping[str, Any], *, cached: bool, best: float | None) -> None:
        self.done += 1
        values = database.decode_values(candidate.get("values", {}))
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        how = "cached" if cached else ("failed" if "error" in candidate else "measured")
        took = time.monotonic() - self.started
        self.console.print(
            escape(
                f"autotune {self.done}/{self.total} ({took:.0f} s): {how} {shown}"
                f" {format_time(candidate.get('time_s'))}; best {format_time(best)}"
            ),
            soft_wrap=True,
        )


def wide(console: Console) -> Console:
    """``console``, or, when it is no terminal (a pipe, a file), one as wide as a table needs:
    rich fits tables to 80 columns there, which cut the layout table to 6-character cells."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=max(console.width, 400), soft_wrap=True)


class Reporter:
    """Progress on stderr (``progress_console``), the final table on ``console``."""

    def __init__(self, console: Console | None = None, progress_console: Console | None = None):
        self.console = console or wide(Console())
        self.progress_console = progress_console or Console(stderr=True)

    @contextlib.contextmanager
    def progress(self, total: int) -> Iterator[_Bar | _Lines]:
        if not self.progress_console.is_terminal:
            yield _Lines(self.progress_console, total)
            return
        columns = (
            TextColumn("autotune"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        with Progress(*columns, console=self.progress_console, transient=False) as progress:
            yield _Bar(progress, progress.add_task("starting the workers", total=total))

    def note(self, text: str) -> None:
        self.progress_console.print(escape(text), soft_wrap=True)

    def summary(self, outcome: Outcome, elapsed: float) -> None:
        if outcome.predictions is not None:
            self.console.print(layout_table(outcome))
            by_reason: dict[str, list[str]] = {}
            for candidate, why in outcome.space.excluded:
                shown = "/".join(f"{v}" for v in candidate.values())
                by_reason.setdefault(why, []).append(shown)
            for why, names in by_reason.items():
                self.console.print(escape(f"infeasible: {why}: {', '.join(names)}"))
            measured = sum(
                1
                for c in (outcome.record or {}).get("candidates", [])
                if database.canonical(database.decode_values(c["values"]))
                in {database.canonical(x) for x in outcome.space.candidates}
            )
            self.console.print(
                f"measured {measured} of {len(outcome.space.candidates)} feasible layouts"
                f" (exhaustive: {len(outcome.space.candidates)})"
            )
            if outcome.finalists:
                names = [
                    outcome.predictions[f].layout.describe(outcome.world_size)
                    for f in outcome.finalists
                ]
                self.console.print(
                    escape(
                        f"the {len(names)} leading layouts timed side by side, in turns:"
                        f" {', '.join(names)}; the winner {outcome.verdict}"
                    )
                )
        else:
            self.console.print(table(outcome))
        winner = outcome.winner
        measured_any = any("time_s" in c for c in (outcome.record or {}).get("candidates", []))
        if winner:
            chosen = ", ".join(f"{k}={v!r}" for k, v in winner.items())
        elif outcome.stopped == "budget" and not measured_any:
            chosen = (
                "none (the budget ran out before the first measurement; expand uses the defaults)"
            )
        else:
            chosen = "none (every candidate failed; expand uses the defaults)"
        on = f" on {outcome.device.get('name')}" if outcome.device else ""
        self.console.print(
            f"winner{on}: {chosen}; {outcome.new_measurements} new measurement(s),"
            f" {outcome.strategy} search ({outcome.stopped}), {elapsed:.1f} s;"
            f" tuning database: {outcome.database}"
        )


def table(outcome: Outcome) -> Table:
    keys = [p.key for p in outcome.space.parameters]
    t = Table(title="macrogen autotune", show_lines=False)
    for key in keys:
        t.add_column(key, justify="right")
    t.add_column("time / step", justify="right")
    t.add_column("vs best", justify="right")
    t.add_column("measured")
    t.add_column("result")
    if outcome.skipped:  # parameters that change nothing here: left at their defaults
        t.caption = "not tuned here (default kept): " + "; ".join(
            escape(f"{p.key}={p.default!r}: {why}") for p, why in outcome.skipped
        )
    record = outcome.record
    if record is None:
        return t
    allowed = {database.canonical(c) for c in outcome.space.candidates}
    rows = [
        c
        for c in record["candidates"]
        if database.canonical(database.decode_values(c["values"])) in allowed
    ]
    best = min((c["time_s"] for c in rows if "time_s" in c), default=None)
    winner = None if outcome.winner is None else database.canonical(outcome.winner)
    rows.sort(key=lambda c: (c.get("time_s") is None, c.get("time_s") or 0.0))
    for c in rows:
        values = database.decode_values(c["values"])
        time_s = c.get("time_s")
        ratio = f"x{time_s / best:.3f}" if time_s is not None and best else "-"
        if database.canonical(values) == winner:
            result = "[bold green]winner[/]"
        elif "error" in c:
            result = f"[red]failed[/]: {escape(c['error'])}"
        else:
            result = ""
        when = "now" if database.canonical(values) in outcome.measured_now else "before"
        t.add_row(*(repr(values.get(k)) for k in keys), format_time(time_s), ratio, when, result)
    return t


def layout_table(outcome: Outcome) -> Table:
    """Layouts: predicted and measured step time and peak memory per rank, best measured first,
    then the others as the fitted model ranks them."""
    from macrogen.autotune import cost
    from macrogen.autotune.memory import format_bytes

    assert outcome.predictions is not None
    t = Table(title=f"macrogen autotune: layouts on {outcome.world_size} rank(s)")
    for name in (
        "layout",
        "predicted / step (fitted)",
        "measured / step",
        "vs best",
        "predicted peak",
        "measured peak (max rank)",
        "tokens/s",
        "measured",
        "result",
    ):
        t.add_column(name, justify="left" if name in ("layout", "measured", "result") else "right")
    found = {
        database.canonical(database.decode_values(c["values"])): c
        for c in (outcome.record or {}).get("candidates", [])
    }
    rows = []
    for candidate in outcome.space.candidates:
        ident = database.canonical(candidate)
        rows.append((outcome.predictions[ident], found.get(ident), ident))
    best = min((c["time_s"] for _, c, _ in rows if c and "time_s" in c), default=None)
    winner = None if outcome.winner is None else database.canonical(outcome.winner)
    # the cost model scaled to what was measured (compute and communication terms)
    fitted = cost.fit([(p.step, c["time_s"]) for p, c, _ in rows if c and "time_s" in c])
    # the measured by time, then the rest by the fitted prediction (the search's order now)
    rows.sort(
        key=lambda r: (0, r[1]["time_s"]) if r[1] and "time_s" in r[1] else (1, fitted(r[0].step))
    )
    for pred, c, ident in rows:
        time_s = c.get("time_s") if c else None
        peaks = c.get("peak_bytes") if c else None
        result = ""
        if ident == winner:
            result = "[bold green]winner[/]"
        elif c and "error" in c:
            result = f"[red]failed[/]: {escape(c['error'])}"
        elif c is None:
            result = "not measured (predicted slower)"
        if c and len(c.get("times", ())) > 1:  # a finalist: timed again side by side
            result += f"{', ' if result else ''}median of {len(c['times'])} runs"
        when = "-" if c is None else ("now" if ident in outcome.measured_now else "before")
        t.add_row(
            escape(pred.layout.describe(outcome.world_size)),
            format_time(fitted(pred.step)),
            format_time(time_s),
            f"x{time_s / best:.3f}" if time_s and best else "-",
            format_bytes(pred.memory.total),
            format_bytes(max(peaks)) if peaks else "-",
            f"{c['tokens_s']:.0f}" if c and "tokens_s" in c else "-",
            when,
            result,
        )
    return t
