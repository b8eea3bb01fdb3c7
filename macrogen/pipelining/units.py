"""A pipelined ``forward`` as units, and where stages can be cut from them.

Pure Python (no ``ast``, no torch), shared by the ``@pipeline`` macro, which
analyses forward's source at expansion (``analysis.py``) and
generates one function per statement, and ``macrogen.runtime.pipeline``, which
only chooses the boundaries and calls those functions. A splittable forward::

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(pos)      # a statement: one unit
        for block in self.blocks:              # a loop over a ModuleList: one unit per block
            x = block(x)
        return self.lm_head(self.ln_f(x))      # the final return: the last stage's output

A stage starts at a top-level statement or at one block of such a loop. At
each cut exactly one local value is still needed after it (``x``): that
tensor is what the stage sends to the next one. Paths reach through
containers (``transformer.h.3``). A second parameter with a default
(nanoGPT's ``targets=None``) is no value a cut carries: it reaches the last
stage only.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED = (
    "statements, `for block in self.<ModuleList>:` loops and one final `return`;"
    " a stage starts at a top-level statement or at one block of such a loop"
)


class SplitError(ValueError):
    """A forward (or a split of it) that pipeline stages can't be cut from.

    ``path`` locates the statement: its index in forward's body (a ``;``-line
    counts one per statement, as in ``ast``), then, inside a loop, in the loop's body.
    """

    def __init__(self, message: str, path: tuple[int, ...] = ()):
        super().__init__(message)
        self.message = message
        self.path = path


@dataclass(frozen=True)
class Statement:
    """One top-level statement of forward, generated as a function at expansion.

    ``fn(self, *reads)`` (a loop's: ``fn(self, block, *reads)``, once per block) runs it
    and returns ``writes`` (one value: itself; the final return: forward's output).
    """

    fn: Callable[..., Any] | None  # None while the macro analyses forward
    index: int  # position in forward's body
    reads: tuple[str, ...] = ()  # local names it reads before assigning them
    writes: tuple[str, ...] = ()  # local names it assigns that a later statement reads
    parts: tuple[str, ...] = ()  # self.<path>s it reads, in source order (not the loop's list)
    calls: tuple[str, ...] = ()  # self.<path>(...) called at top level: split names it may start
    loop: str | None = None  # "transformer.h" for `for block in self.transformer.h:`

    @property
    def attrs(self) -> frozenset[str]:
        """Every self.<path> it reads (the parts of the model it needs)."""
        return frozenset(self.parts) | ({self.loop} if self.loop else set())


@dataclass(frozen=True)
class Unit:
    """What one stage runs in order: a statement, or one block of a loop."""

    statement: Statement
    block: int | None  # the block of a loop (None: the statement itself)

    @property
    def name(self) -> str:
        """The split name that starts a stage here: ``transformer.h.3``, ``ln_f`` or ``#4``."""
        if self.block is not None:
            return f"{self.statement.loop}.{self.block}"
        calls = self.statement.calls
        return calls[0] if len(calls) == 1 else f"#{self.statement.index}"

    @property
    def parts(self) -> list[str]:
        """The parts of the model it uses, in source order: ``blocks.3``, or ``wte``, ``wpe``."""
        if self.block is not None:
            return [self.name]
        return list(self.statement.parts)


@dataclass(frozen=True)
class Forward:
    """forward as units: its parameters, its statements (the final return last)."""

    params: tuple[str, ...]  # parameters after self
    statements: tuple[Statement, ...]
    # forward's second parameter when it has a default (nanoGPT's ``targets=None``): no cut
    # carries it; pipeline_step without a loss_fn gives the last stage y there
    targets: str | None = None

    @property
    def loops(self) -> tuple[str, ...]:
        return tuple(s.loop for s in self.statements if s.loop is not None)

    def units(self, blocks: dict[str, int]) -> list[Unit]:
        """Every unit, with ``blocks[loop]`` blocks in each loop's ModuleList."""
        out: list[Unit] = []
        for s in self.statements:
            if s.loop is None:
                out.append(Unit(s, None))
            else:
                out.extend(Unit(s, b) for b in range(blocks[s.loop]))
        return out


def carried(forward: Forward, units: list[Unit], cut: int) -> list[str]:
    """The local names units[cut:] still need from before the cut (forward's parameters included).

    The targets parameter is left out: it reaches the last stage on its own.
    """
    before: set[str] = set(forward.params) - {forward.targets}
    for u in units[:cut]:
        before |= set(u.statement.writes)
    exposed: set[str] = set()
    assigned: set[str] = set()
    for u in units[cut:]:
        exposed |= set(u.statement.reads) - assigned
        assigned |= set(u.statement.writes)
    return sorted(exposed & before)


def resolve_split(forward: Forward, units: list[Unit], split: list[str]) -> list[int]:
    """Unit indices where stages 1.. start, for split names like ``blocks.3`` or ``ln_f``."""
    starts: list[int] = []
    for name in split:
        hits = [k for k, u in enumerate(units) if _starts_with(u, name)]
        if not hits:
            raise SplitError(unknown_split_message(forward, units, name))
        if len(hits) > 1:
            raise SplitError(
                f"split name {name!r} is called by more than one statement of forward"
                f" (statements {', '.join('#' + str(units[k].statement.index) for k in hits)});"
                " name a block (`blocks.3`) or a submodule called once"
            )
        starts.append(hits[0])
    if any(b <= a for a, b in zip(starts, starts[1:])) or (starts and starts[0] == 0):
        raise SplitError(
            f"split {split!r} must name stage starts in forward's order, after its first statement"
        )
    return starts


def _starts_with(unit: Unit, name: str) -> bool:
    if unit.block is not None:
        return unit.name == name
    return name in unit.statement.calls or name == f"#{unit.statement.index}"


def split_names(units: list[Unit]) -> list[str]:
    """Every name a split may use, in forward's order."""
    names: list[str] = []
    for u in units:
        if u.block is not None:
            names.append(u.name)
        else:
            names.extend(sorted(u.statement.calls))
    return names


def unknown_split_message(
    forward: Forward, units: list[Unit], name: str, open_ended: frozenset[str] = frozenset()
) -> str:
    """Why ``name`` starts no stage, and the names that do (``open_ended``: loops whose
    length only the run time knows, shown ``transformer.h.0-1..``)."""
    names = split_names(units[1:])  # stage 0 starts at the first unit: no split name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    head, _, tail = name.rpartition(".")
    if head in forward.loops and tail.isdigit():
        n = sum(1 for u in units if u.statement.loop == head)
        return f"split name {name!r}: self.{head} has {n} blocks ({head}.0 to {head}.{n - 1})"
    if name in forward.loops:
        blocks = [u.name for u in units[1:] if u.statement.loop == name]
        text = runs(blocks)
        if name in open_ended and blocks:
            text = open_end(
                text, name, max(u.block or 0 for u in units if u.statement.loop == name)
            )
        return (
            f"split name {name!r} is the list forward loops over: name the block that starts"
            f" the stage ({text})"
        )
    shown = starts_text(units, open_ended)
    return f"split name {name!r} is no submodule forward calls at top level{hint} ({shown})"


def starts_text(units: list[Unit], open_ended: frozenset[str] = frozenset()) -> str:
    """``stages may start at: transformer.wte, transformer.h.1-11, ...``, never an empty list."""
    names = split_names(units[1:])
    if not names:
        return (
            "and none may: forward calls no submodule at top level after its first statement"
            f" (supported: {SUPPORTED})"
        )
    text = runs(names)
    for loop in open_ended:
        last = max(u.block for u in units if u.statement.loop == loop and u.block is not None)
        text = open_end(text, loop, last)
    return f"stages may start at: {text}"


def open_end(text: str, loop: str, last: int) -> str:
    """``blocks.0-3`` -> ``blocks.0-3..``: the list may be longer at run time."""
    return re.sub(rf"\b{re.escape(loop)}\.(\d+-)?{last}\b", r"\g<0>..", text)


def check_cuts(
    forward: Forward, units: list[Unit], starts: list[int], names: list[str] | None = None
) -> list[str]:
    """The one value each cut carries; an error naming the cut when it is not exactly one."""
    values = []
    for k, cut in enumerate(starts):
        live = carried(forward, units, cut)
        unit = units[cut]
        if len(live) != 1:
            what = ", ".join(live) if live else "nothing"
            raise SplitError(
                f"a stage can't start at {names[k] if names else unit.name!r}: forward still"
                f" needs {what} from before it, and a stage boundary carries exactly one tensor"
                f" (supported: {SUPPORTED})",
                (unit.statement.index,),
            )
        values.append(live[0])
    if forward.targets and starts:
        _targets_last(forward, units, starts[-1])
    return values


def _targets_last(forward: Forward, units: list[Unit], last: int) -> None:
    """The targets parameter reaches the last stage only: no earlier unit may read it."""
    for unit in units[:last]:
        if forward.targets in unit.statement.reads:
            raise SplitError(
                f"{forward.targets!r} (forward's targets parameter) reaches the last stage only,"
                f" and {unit.name!r} reads it before that stage starts at"
                f" {units[last].name!r}: cut after it, or read {forward.targets} in the last"
                " stage only",
                (unit.statement.index,),
            )


def balanced(
    weights: list[int],
    candidates: list[int],
    stages: int,
    speeds: list[float] | None = None,
    limits: list[float] | None = None,
) -> list[int]:
    """Stage starts among ``candidates`` (unit indices) that best balance the units' weights.

    Minimizes the heaviest stage (exact: dynamic programming over the candidates). With
    ``speeds`` (one per stage: its device's relative speed), a stage's load is its weight
    over its speed: a device twice as fast takes twice the weight (uneven stages). With
    ``limits`` (one per stage: the most weight its memory holds), no stage takes more; a
    SplitError when no cut fits.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts = [0, *candidates, n]
    # best[k][j]: the lightest heaviest-stage for units[:cuts[j]] in k stages
    inf = float("inf")
    best: list[list[float]] = [[inf] * len(cuts) for _ in range(stages + 1)]
    back = [[0] * len(cuts) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(1, len(cuts)):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                load = prefix[cuts[j]] - prefix[cuts[i]]
                if limits is not None and load > limits[k - 1]:
                    continue  # over this stage's memory
                cost = max(best[k - 1][i], load if speeds is None else load / speeds[k - 1])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    j, starts = len(cuts) - 1, []
    if best[stages][j] == inf:
        held = ", ".join(f"{x:.3g}" for x in limits or ())
        raise SplitError(
            f"no cut into {stages} stages fits their memory: the stages hold at most {held}"
            f" parameters, and the model's parts weigh {prefix[-1]} in all"
        )
    for k in range(stages, 0, -1):
        i = back[k][j]
        starts.append(cuts[i])
        j = i
    return sorted(starts)[1:]


def runs(names: list[str]) -> str:
    """``blocks.0, blocks.1, blocks.2, ln_f`` -> ``blocks.0-2, ln_f``."""
    out: list[str] = []
    for name in names:
        head, _, tail = name.rpartition(".")
        if out and head and tail.isdigit():
            prev_head, _, prev_tail = out[-1].rpartition(".")
            first, _, last = prev_tail.partition("-")
            if (
                prev_head == head
                and (last or first).isdigit()
                and int(last or first) + 1 == int(tail)
            ):
                out[-1] = f"{head}.{first}-{tail}"
                continue
        out.append(name)
    return ", ".join(out)


def split_count_message(stages: int, given: int) -> str:
    wanted = "stage 1 starts" if stages == 2 else f"stages 1 to {stages - 1} start"
    return (
        f"split names where {wanted}: {stages - 1} name{'s' if stages > 2 else ''} for"
        f" {stages} stages, not {given}"
    )


def interleaving_problem(stages: int, m: int, schedule: str, spr: int) -> str | None:
    """What is wrong with ``stages_per_rank`` (spr) for the schedule, if anything.

    The macro says it at expansion, the runtime at construction.
    """
    if schedule != "interleaved":
        if spr != 1:
            return (
                f"stages_per_rank={spr} needs schedule='interleaved' ({schedule!r} runs"
                " one stage per rank)"
            )
        return None
    if spr < 2 or stages % spr:
        return f"interleaved needs stages_per_rank >= 2 that divides stages ({stages}), not {spr}"
    ranks = stages // spr
    if ranks < 2:
        return f"{stages} stages at {spr} per rank is one pipeline rank: nothing to interleave"
    rounds = max(1, m // ranks)
    if m % rounds:  # torch's ScheduleInterleaved1F1B runs micro-batches in equal rounds
        return (
            f"interleaved on {ranks} pipeline ranks runs {rounds} rounds of micro-batches:"
            f" microbatches={m} is not a multiple of {rounds}"
        )
    return None
