"""A model's ``forward`` as a sequence of units that pipeline stages can be cut from.

Pure ``ast`` (no torch): the ``@pipeline`` macro uses it at expansion time to
report a forward it can't split, and ``macrogen.runtime.pipeline`` uses it at
run time to build each stage's code. A splittable forward is::

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(pos)      # a statement: one unit
        for block in self.blocks:              # a loop over a ModuleList: one unit per block
            x = block(x)
        return self.lm_head(self.ln_f(x))      # the final return: the last stage's output

A stage starts at a top-level statement or at one block of such a loop. At
each cut exactly one local value is still needed after it (``x``): that
tensor is what the stage sends to the next one. Any other statement (an
``if``, a ``with``, a loop over something else) is one unit that runs wholly
inside one stage.

Paths reach through containers: ``for block in self.transformer.h:`` loops
over ``transformer.h`` (a ModuleList inside a ModuleDict), its blocks are
``transformer.h.0``, ... and ``self.transformer.wte(idx)`` calls
``transformer.wte``. A second parameter with a default (nanoGPT's
``targets=None``) is no value a cut carries: it reaches the last stage only,
where a forward that computes its own loss reads it.
"""

from __future__ import annotations

import ast
import copy
import difflib
import re
import textwrap
from dataclasses import dataclass

SUPPORTED = (
    "statements, `for block in self.<ModuleList>:` loops and one final `return`;"
    " a stage starts at a top-level statement or at one block of such a loop"
)


class SplitError(ValueError):
    """A forward (or a split of it) that pipeline stages can't be cut from.

    ``path`` locates the statement: its index in forward's body (a ``;``-line
    counts one per statement, as in ``ast``), then, inside a loop, in the loop's body.
    """

    def __init__(self, message: str, path: tuple[int, ...] = (), line: int = 0):
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line  # 1-based line in the analysed source (0: unknown)


@dataclass(frozen=True)
class Statement:
    """One top-level statement of forward's body."""

    index: int  # position in forward's body
    node: ast.stmt
    loop: str | None  # "transformer.h" for `for block in self.transformer.h:` (a unit per block)
    calls: frozenset[str]  # self.<path>(...) called here at top level (split names it may start)
    attrs: frozenset[str]  # every self.<path> read here (the parts of the model it needs)
    parts: tuple[str, ...] = ()  # those paths in source order, the loop's own list left out
    inner: frozenset[str] = frozenset()  # self.<path>(...) called anywhere in it, nested too


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
        calls = sorted(self.statement.calls)
        return calls[0] if len(calls) == 1 else f"#{self.statement.index}"

    @property
    def parts(self) -> list[str]:
        """The parts of the model it uses, in source order: ``blocks.3``, or ``wte``, ``wpe``."""
        if self.block is not None:
            return [self.name]
        return list(self.statement.parts)


@dataclass(frozen=True)
class Forward:
    """forward's analysis: its signature, its statements and where it can be cut."""

    node: ast.FunctionDef
    self_name: str
    params: tuple[str, ...]  # parameters after self
    statements: tuple[Statement, ...]  # the final return is the last
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


def parse(source: str) -> Forward:
    """Analyse forward's source (a ``def forward(self, ...)``, indented or not)."""
    tree = ast.parse(textwrap.dedent(source))
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SplitError("expected a forward method")
    return analyse(fn)  # type: ignore[arg-type]


def analyse(fn: ast.FunctionDef) -> Forward:
    if isinstance(fn, ast.AsyncFunctionDef):
        raise SplitError("forward is async: a pipeline stage runs a plain forward", (), fn.lineno)
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if not positional:
        raise SplitError("forward takes no self", (), fn.lineno)
    me = positional[0].arg
    body = list(fn.body)
    first = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        first = 1  # a docstring is no unit
    statements: list[Statement] = []
    for i, stmt in enumerate(body[first:], start=first):
        last = i == len(body) - 1
        statements.append(_statement(i, stmt, me, last))
    if not statements or not isinstance(statements[-1].node, ast.Return):
        where = body[-1] if body else fn
        raise SplitError(
            "forward must end with `return <output>`: the last stage's output goes to the loss"
            f" (supported: {SUPPORTED})",
            (len(body) - 1,) if body else (),
            where.lineno,
        )
    params = tuple(a.arg for a in [*positional[1:], *args.kwonlyargs])
    # defaults belong to the last positional parameters: the second has one if enough do
    with_default = len(positional) > 2 and len(args.defaults) >= len(positional) - 2
    targets = positional[2].arg if with_default else None
    return Forward(fn, me, params, tuple(statements), targets)


def _statement(i: int, stmt: ast.stmt, me: str, last: bool) -> Statement:
    for node in ast.walk(stmt):
        bad = None
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            bad = "forward yields: a pipeline stage runs a plain function"
        elif isinstance(node, ast.Return) and not (last and node is stmt):
            bad = (
                "a return before the end of forward (or inside a statement) can't be split:"
                " forward must run straight through to one final return"
            )
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bad = "global/nonlocal in forward can't be split"
        if bad is not None:
            raise SplitError(
                f"{bad} (supported: {SUPPORTED})", (i,), getattr(node, "lineno", stmt.lineno)
            )
    loop = _module_list_loop(stmt, me)
    if loop is not None:
        for j, inner in enumerate(stmt.body):  # type: ignore[attr-defined]
            for node in ast.walk(inner):
                if isinstance(node, (ast.Break, ast.Continue)):
                    raise SplitError(
                        f"break/continue in the loop over self.{loop}: every block must run"
                        f" (supported: {SUPPORTED})",
                        (i, j),
                        getattr(node, "lineno", stmt.lineno),
                    )
    found = sorted(
        (getattr(n, "lineno", 0), getattr(n, "col_offset", 0), a) for n, a in _paths(stmt, me)
    )
    parts = tuple(dict.fromkeys(a for _, _, a in found if a != loop))
    attrs = frozenset(a for _, _, a in found)
    inner = _called(stmt, me)
    calls = inner if isinstance(stmt, _SIMPLE) else frozenset()
    return Statement(i, stmt, loop, calls, attrs, parts, inner)


_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)


def _module_list_loop(stmt: ast.stmt, me: str) -> str | None:
    """``transformer.h`` for ``for block in self.transformer.h:`` (a plain variable, no else)."""
    if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and not stmt.orelse:
        return self_path(stmt.iter, me)
    return None


def self_path(node: ast.AST, me: str) -> str | None:
    """``transformer.wte`` for ``self.transformer.wte``: the attribute path from ``self``."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if names and isinstance(node, ast.Name) and node.id == me:
        return ".".join(reversed(names))
    return None


def _paths(stmt: ast.stmt, me: str) -> list[tuple[ast.AST, str]]:
    """Every whole ``self.a.b.c`` in stmt (not its prefixes ``self.a``, ``self.a.b``)."""
    inside = {id(n.value) for n in ast.walk(stmt) if isinstance(n, ast.Attribute)}
    return [
        (n, p)
        for n in ast.walk(stmt)
        if id(n) not in inside and (p := self_path(n, me)) is not None
    ]


def _called(stmt: ast.stmt, me: str) -> frozenset[str]:
    """self.<path>(...) calls anywhere in stmt."""
    return frozenset(
        a
        for n in ast.walk(stmt)
        if isinstance(n, ast.Call) and (a := self_path(n.func, me)) is not None
    )


def _chain(me: str, path: str) -> ast.expr:
    """``self.transformer.h`` from ``transformer.h``."""
    node: ast.expr = ast.Name(me, ast.Load())
    for name in path.split("."):
        node = ast.Attribute(node, name, ast.Load())
    return node


# -- where values live ---------------------------------------------------------------


def _names(nodes: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """(names read before this code assigns them, names it assigns), statement by statement."""
    exposed: set[str] = set()
    assigned: set[str] = set()
    for stmt in nodes:
        reads: set[str] = set()
        writes: set[str] = set()
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name):
                (reads if isinstance(n.ctx, ast.Load) else writes).add(n.id)
            elif isinstance(n, ast.arg):
                writes.add(n.arg)
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            reads.add(stmt.target.id)
        exposed |= reads - assigned
        assigned |= writes
    return exposed, assigned


def unit_code(forward: Forward, unit: Unit) -> list[ast.stmt]:
    """The statements one unit runs (a block: ``block = self.transformer.h[3]``, the loop body)."""
    stmt = unit.statement.node
    if unit.block is None:
        return [stmt]
    loop = stmt
    assert isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)
    assert unit.statement.loop is not None
    pick = ast.Assign(
        targets=[ast.Name(loop.target.id, ast.Store())],
        value=ast.Subscript(
            value=_chain(forward.self_name, unit.statement.loop),
            slice=ast.Constant(unit.block),
            ctx=ast.Load(),
        ),
    )
    ast.copy_location(pick, loop)
    return [pick, *loop.body]


def carried(forward: Forward, units: list[Unit], cut: int) -> list[str]:
    """The local names units[cut:] still need from before the cut (forward's parameters included).

    The targets parameter is left out: it reaches the last stage on its own.
    """
    before: set[str] = set(forward.params) - {forward.targets}
    for u in units[:cut]:
        before |= _names(unit_code(forward, u))[1]
    after: list[ast.stmt] = [st for u in units[cut:] for st in unit_code(forward, u)]
    exposed, _ = _names(after)
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
            text = open_end(text, name, max(u.block or 0 for u in units if u.statement.loop == name))
        return (
            f"split name {name!r} is the list forward loops over: name the block that starts"
            f" the stage ({text})"
        )
    shown = starts_text(units, open_ended)
    nested = next((s for s in forward.statements if name in s.inner and name not in s.calls), None)
    if nested is not None:
        head = ast.unparse(nested.node).splitlines()[0]
        return (
            f"split name {name!r} is called inside `{head}`, which runs wholly in one stage:"
            f" a stage starts at a top-level statement or a block ({shown})"
        )
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
                f"a stage can't start at {names[k] if names else unit.name!r}: forward still needs {what} from before"
                " it, and a stage boundary carries exactly one tensor"
                f" (supported: {SUPPORTED})",
                _path(unit),
                unit.statement.node.lineno,
            )
        values.append(live[0])
    if forward.targets and starts:
        _targets_last(forward, units, starts[-1])
    return values


def _targets_last(forward: Forward, units: list[Unit], last: int) -> None:
    """The targets parameter reaches the last stage only: no earlier unit may read it."""
    for unit in units[:last]:
        if forward.targets in _names(unit_code(forward, unit))[0]:
            raise SplitError(
                f"{forward.targets!r} (forward's targets parameter) reaches the last stage only,"
                f" and {unit.name!r} reads it before that stage starts at"
                f" {units[last].name!r}: cut after it, or read {forward.targets} in the last"
                " stage only",
                _path(unit),
                unit.statement.node.lineno,
            )


def _path(unit: Unit) -> tuple[int, ...]:
    return (unit.statement.index,)


def balanced(weights: list[int], candidates: list[int], stages: int) -> list[int]:
    """Stage starts among ``candidates`` (unit indices) that best balance the units' weights.

    Minimizes the heaviest stage (exact: dynamic programming over the candidates).
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts = [0, *candidates, n]
    # best[k][j]: the lightest heaviest-stage for units[:cuts[j]] in k stages
    inf = float("inf")
    best = [[inf] * len(cuts) for _ in range(stages + 1)]
    back = [[0] * len(cuts) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(1, len(cuts)):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                cost = max(best[k - 1][i], prefix[cuts[j]] - prefix[cuts[i]])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    j, starts = len(cuts) - 1, []
    for k in range(stages, 0, -1):
        i = back[k][j]
        starts.append(cuts[i])
        j = i
    return sorted(starts)[1:]


def stage_function(
    forward: Forward, units: list[Unit], first: int, end: int, inputs: list[str], output: str | None
) -> ast.Module:
    """``def stage(self, <inputs>): <units[first:end]>; return <output>`` (None: the final return)."""
    fn = forward.node
    body: list[ast.stmt] = [
        copy.deepcopy(st) for u in units[first:end] for st in unit_code(forward, u)
    ]
    if output is not None:
        ret = ast.Return(ast.Name(output, ast.Load()))
        ast.copy_location(ret, body[-1])
        body.append(ret)
    if first == 0:
        args = copy.deepcopy(fn.args)
    else:
        names = [forward.self_name, *inputs]
        defaults: list[ast.expr] = []
        if output is None and forward.targets:  # the last stage: targets=None, as forward has
            names.append(forward.targets)
            positional = [*fn.args.posonlyargs, *fn.args.args]
            default = fn.args.defaults[len(fn.args.defaults) - len(positional) + 2]
            defaults.append(copy.deepcopy(default))
        args = ast.arguments(
            posonlyargs=[],
            args=[ast.arg(name) for name in names],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=defaults,
        )
    new = copy.copy(fn)  # keeps the fields each Python version's FunctionDef has
    new.name, new.args, new.body, new.decorator_list, new.returns = "forward", args, body, [], None
    module = ast.Module([new], type_ignores=[])
    return ast.fix_missing_locations(module)


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
        return (
            f"interleaved needs stages_per_rank >= 2 that divides stages ({stages}), not {spr}"
        )
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
