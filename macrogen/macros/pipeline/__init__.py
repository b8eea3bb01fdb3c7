"""``@pipeline(stages=2, ...)`` on an ``nn.Module`` class: its forward cut into pipeline stages.

    @mg.pipeline(stages=2, microbatches=4, schedule="1f1b", split=["blocks.2"])
    class GPT(nn.Module):                          # macrogen: pipeline at train.py:12
        def __init__(self, config): ...            def _GPT_forward_0(self, idx): ...  (forward's statements,
        def forward(self, idx):              ->    def _GPT_forward_1(self, block, x): ...  the user's lines)
            x = self.wte(idx)                      _GPT_forward = Forward(...)
            for block in self.blocks:              # cut: stage 0: wte, blocks.0-1 | stage 1: ...
                x = block(x)                       @pipeline_class(PipelineConfig(stages=2, ...), _GPT_forward,
            return self.head(x)                                    ranks=2, where='train.py:12')
                                                   class GPT(nn.Module):
                                                       ... (the user's class, unchanged)

    for x, y in data:                              # the loop's one pipeline line (serially:
        loss = mg.pipeline_step(model, x, y, F.cross_entropy)   # forward, loss, backward)
        opt.step()

Each statement of forward becomes a function (``_GPT_forward_0``, ...: the
user's lines, copied; a ModuleList loop's body, run once per block), listed
with the local names it reads and passes on in ``_GPT_forward``. The class
keeps its name and identity: ``pipeline_class`` (``macrogen.runtime.parallelize``)
tells the mesh its stages and builds the whole serial model (same
initialization), then ``macrogen.runtime.pipeline`` cuts those functions into
stages (it reads no source), cuts tensor-parallel shards, keeps this rank's
stage and runs torch's
``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``. Arguments (keyword only): ``stages`` (required,
>= 2), ``microbatches`` (4), ``schedule`` ("1f1b", "gpipe" or "interleaved"),
``split`` (names that start stages 1.., e.g. ``["blocks.3"]``; without it the
blocks of forward's ``nn.ModuleList`` loop are balanced by parameter count at
run time), ``stages_per_rank`` (interleaved only; default 2). ``microbatches``,
``schedule`` and ``split`` may be ``tunable``.

Expansion checks what the file shows: a forward that can't be split (naming
the statement), a split name forward doesn't call, more stages than a
literal number of blocks. The rest (world size, parameter counts) is
checked at run time.

Where the rest lives (``macrogen/pipelining/``): ``analysis.py`` reads forward's ``ast``
(its statements, what each reads and writes, what can't be cut); ``code.py`` writes each
statement's function (both shared with ``mg.parallelize(pp=N)``, which cuts a built model's
forward at run time); ``units.py``, shared with the runtime, cuts the units (split names,
the value each cut carries).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst.metadata import PositionProvider

from macrogen.macro import (
    Arg,
    Context,
    Expanded,
    Form,
    InternalError,
    MacroError,
    Site,
    render_statements,
)
from macrogen.macros.class_decorator import decorated, rendered_decorator
from macrogen.macros.pipeline.built import plain_attributes, static_blocks, ties
from macrogen.pipelining.analysis import Analysed, parse
from macrogen.pipelining.code import unit_function
from macrogen.pipelining.units import (
    SUPPORTED,
    Forward,
    SplitError,
    Unit,
    check_cuts,
    interleaving_problem,
    open_end,
    resolve_split,
    runs,
    split_count_message,
    split_names,
    starts_text,
    unknown_split_message,
)
from macrogen.vocabulary import SCHEDULES

NAME = "pipeline"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = (
    "@pipeline(stages=2, microbatches=4, schedule='1f1b', split=['blocks.3'])"
    " decorates an nn.Module class whose forward is a sequence of submodule calls"
)
DEFAULTS: dict[str, Any] = {
    "stages": None,
    "microbatches": 4,
    "schedule": "1f1b",
    "split": None,
    "stages_per_rank": None,  # 1; "interleaved": 2
}


@dataclass(frozen=True)
class Spec:
    name: str  # the user's class
    stages: int  # pipeline stages; world size = stages x data ranks
    microbatches: int  # per step
    schedule: str  # "1f1b" or "gpipe"
    split: tuple[str, ...] | None  # names that start stages 1..; None: balanced at run time
    cut: str  # where it cuts, for the generated docstring
    stages_per_rank: int = 1  # > 1: interleaved, rank r holding stages r, r + P, ...
    tied: tuple[str, ...] = ()  # "transformer.wte.weight = lm_head.weight": shared tensors
    analysed: Analysed | None = None  # forward's statements, each generated as a function
    forward_line: int = 0  # forward's ``def`` line in the source


def validate(site: Site, ctx: Context) -> Spec:
    node = site.original
    if not isinstance(node, cst.ClassDef):
        raise MacroError(f"pipeline() decorates a class: {USAGE}", site.call or site.original)
    if not node.bases:
        raise MacroError(
            f"pipeline() decorates an nn.Module subclass; {node.name.value} has no base class",
            node.name,
        )
    args = site.args.bind(DEFAULTS)
    anchor = site.call or node.name
    if "stages" not in args:
        raise MacroError(f"pipeline() needs stages=N: {USAGE}", anchor)
    stages = args["stages"].value
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise MacroError(f"stages must be a whole number >= 2, not {stages!r}", args["stages"].node)
    microbatches = _choices(args, "microbatches", ctx)
    schedules = _choices(args, "schedule", ctx)
    for n in microbatches:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MacroError(
                f"microbatches must be a whole number >= 1, not {n!r}", args["microbatches"].node
            )
    for s in schedules:
        if s not in SCHEDULES:
            raise MacroError(
                f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, not {s!r}",
                args["schedule"].node,
            )
    spr = args["stages_per_rank"].value if "stages_per_rank" in args else None
    if spr is not None and (isinstance(spr, bool) or not isinstance(spr, int)):
        raise MacroError(
            f"stages_per_rank must be a whole number, not {spr!r}", args["stages_per_rank"].node
        )
    for s in schedules:
        for n in microbatches:
            problem = interleaving_problem(stages, n, s, _stages_per_rank(spr, s))
            if problem:
                at = args.get("stages_per_rank") or args.get("schedule")
                raise MacroError(problem, at.node if at else anchor)
    if "1f1b" in schedules and any(n < stages for n in microbatches):
        at = args.get("microbatches") or args.get("schedule")
        raise MacroError(
            f"1f1b needs at least as many micro-batches as stages ({stages}):"
            f" microbatches={min(microbatches)}",
            at.node if at else anchor,
        )
    forward_node = _forward(node)
    analysed = _analyse(forward_node)
    forward = analysed.forward
    blocks = static_blocks(node, forward, ctx)
    splits = _choices(args, "split", ctx) if "split" in args else [None]
    cut, placed = "", None
    plain = plain_attributes(node)
    for split in splits:
        cut, placed = _check_split(
            split, stages, analysed, forward_node, blocks, args, anchor, plain
        )
    value = args["split"].value if "split" in args else None
    return Spec(
        node.name.value,
        stages,
        args["microbatches"].value if "microbatches" in args else DEFAULTS["microbatches"],
        args["schedule"].value if "schedule" in args else DEFAULTS["schedule"],
        None if value is None else tuple(value),
        cut,
        _stages_per_rank(spr, args["schedule"].value if "schedule" in args else "1f1b"),
        ties(node, placed),
        analysed,
        _line_of(node, forward_node.name, site),
    )


def _line_of(cls: cst.ClassDef, node: cst.CSTNode, site: Site) -> int:
    """``node``'s line in the source, counted from the macro call's (``site.line``)."""
    wrapper = cst.MetadataWrapper(cst.Module([cls]), unsafe_skip_copy=True)
    where = wrapper.resolve(PositionProvider)
    call = site.call if site.call is not None and site.call in where else cls.name
    return site.line + where[node].start.line - where[call].start.line


def _stages_per_rank(given: int | None, schedule: str) -> int:
    return given if given is not None else (2 if schedule == "interleaved" else 1)


def _choices(args: dict[str, Arg], name: str, ctx: Context) -> list[Any]:
    """The value, and every choice of a tunable (autotune may pick any of them)."""
    if name not in args:
        return [DEFAULTS[name]]
    arg = args[name]
    if arg.tunable is not None and arg.tunable in ctx.tunables:
        return list(ctx.tunables[arg.tunable].choices)
    return [arg.value]


# -- forward ----------------------------------------------------------------------------


def _forward(cls: cst.ClassDef) -> cst.FunctionDef:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            return stmt
    raise MacroError(
        f"@pipeline cuts {cls.name.value}'s own forward into stages, and {cls.name.value}"
        " defines none here",
        cls.name,
    )


def _analyse(fn: cst.FunctionDef) -> Analysed:
    code = cst.Module([]).code_for_node(fn.with_changes(decorators=(), leading_lines=()))
    try:
        return parse(code)
    except SplitError as e:
        raise MacroError(
            f"forward can't be cut into pipeline stages: {e.message}", _statement(fn, e.path)
        ) from None


def _flat(body: cst.BaseSuite) -> list[cst.CSTNode]:
    """Statements as ``ast`` counts them: each of ``a; b`` on its own."""
    out: list[cst.CSTNode] = []
    for stmt in getattr(body, "body", ()):
        out.extend(stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt])
    return out


def _statement(fn: cst.FunctionDef, path: tuple[int, ...]) -> cst.CSTNode:
    node: cst.CSTNode = fn.name
    body: cst.BaseSuite = fn.body
    for i in path:
        flat = _flat(body)
        if not 0 <= i < len(flat):
            break
        node = flat[i]
        body = getattr(node, "body", None)  # type: ignore[assignment]
        if body is None:
            break
    return node


def _check_split(
    split: Any,
    stages: int,
    analysed: Analysed,
    fn: cst.FunctionDef,
    blocks: dict[str, int | None],
    args: dict[str, Arg],
    anchor: cst.CSTNode,
    plain: frozenset[str] = frozenset(),
) -> tuple[str, list[list[str]] | None]:
    """Check one split (or None) against forward; where it cuts, as the docstring says it,
    and each stage's parts (None: the run time cuts)."""
    forward = analysed.forward
    loops = forward.loops
    if split is None:
        if not loops and not split_names(forward.units({})[1:]):
            raise MacroError(
                "forward can't be cut into pipeline stages: it has no `for block in"
                " self.<ModuleList>:` loop and calls no submodule at top level after its first"
                f" statement (supported: {SUPPORTED})",
                fn.name,
            )
        if not loops:
            raise MacroError(
                "without split=[...], @pipeline balances the blocks of a `for block in"
                " self.<ModuleList>:` loop in forward, and this forward has none: name the"
                f" submodules that start stages 1..{stages - 1} (split=[...];"
                f" {starts_text(forward.units({}))})",
                fn.name,
            )
        total = [blocks[lp] for lp in loops]
        if all(n is not None for n in total) and stages > sum(total):  # type: ignore[arg-type]
            raise MacroError(
                f"{stages} stages but forward's loop over self.{loops[0]} has"
                f" {sum(total)} blocks: at most one stage per block",  # type: ignore[arg-type]
                args["stages"].node,
            )
        # a cut between two blocks must carry one value
        at_least_two = {lp: max(2, blocks[lp] or 2) for lp in loops}
        units = forward.units(at_least_two)
        first = next(k for k, u in enumerate(units) if u.block == 1)
        _cuts(forward, fn, units, [first], None, anchor)
        return f"at run time, between blocks of self.{loops[0]}, balancing parameter counts", None
    node = args["split"].node
    if not isinstance(split, (list, tuple)) or not all(isinstance(s, str) for s in split):
        raise MacroError(
            f"split must be a list of submodule names ('blocks.3'), not {split!r}", node
        )
    if len(split) != stages - 1:
        raise MacroError(split_count_message(stages, len(split)), node)
    counts: dict[str, int] = {}
    for lp in loops:
        wanted = [b for s in split if (b := _block_of(s, lp)) is not None]
        known = blocks[lp]
        counts[lp] = known if known is not None else max([1, *wanted]) + 1
    units = forward.units(counts)
    open_ended = frozenset(lp for lp in loops if blocks[lp] is None)
    for k, name in enumerate(split):
        el = _element(node, k)
        if not any(_names(u, name) for u in units):
            raise MacroError(_unknown(analysed, units, name, open_ended), el)
    try:
        starts = resolve_split(forward, units, list(split))
    except SplitError as e:
        raise MacroError(e.message, node) from None
    _cuts(forward, fn, units, starts, list(split), node)
    edges = [0, *starts, len(units)]
    described = []
    placed = []
    for s in range(stages):
        parts = [
            p
            for u in units[edges[s] : edges[s + 1]]
            for p in u.parts
            if p.partition(".")[0] not in plain
        ]
        placed.append(parts)
        text = runs(parts)
        for lp in open_ended:  # the last block is the run time's: "blocks.3.."
            text = open_end(text, lp, counts[lp] - 1)
        described.append(f"stage {s}: {text}")
    return " | ".join(described), placed


def _unknown(analysed: Analysed, units: list[Unit], name: str, open_ended: frozenset[str]) -> str:
    """Why ``name`` starts no stage: also when a statement calls it inside an ``if``."""
    forward = analysed.forward
    head, _, tail = name.rpartition(".")
    loop_name = (head in forward.loops and tail.isdigit()) or name in forward.loops
    for s, node, inner in zip(forward.statements, analysed.nodes, analysed.inner):
        if not loop_name and name in inner and name not in s.calls:
            text = ast.unparse(node).splitlines()[0]
            return (
                f"split name {name!r} is called inside `{text}`, which runs wholly in one"
                f" stage: a stage starts at a top-level statement or a block"
                f" ({starts_text(units, open_ended)})"
            )
    return unknown_split_message(forward, units, name, open_ended)


def _block_of(name: str, loop: str) -> int | None:
    head, _, tail = name.rpartition(".")
    return int(tail) if head == loop and tail.isdigit() else None


def _names(unit: Unit, name: str) -> bool:
    return unit.name == name if unit.block is not None else name in unit.statement.calls


def _cuts(
    forward: Forward,
    fn: cst.FunctionDef,
    units: list[Unit],
    starts: list[int],
    names: list[str] | None,
    anchor: cst.CSTNode,
) -> None:
    try:
        check_cuts(forward, units, starts, names)
    except SplitError as e:
        raise MacroError(e.message, _statement(fn, e.path) if e.path else anchor) from None


def _element(node: cst.BaseExpression, k: int) -> cst.CSTNode:
    if isinstance(node, (cst.List, cst.Tuple)) and k < len(node.elements):
        return node.elements[k].value
    return node


# -- expansion ----------------------------------------------------------------------------


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    for text in (spec.cut, *spec.tied):  # they go into comments: names only
        if not re.fullmatch(r"[\w.,:|()=\- ]*", text):
            raise InternalError(f"pipeline: unexpected text in the cut description {text!r}")
    assert isinstance(site.node, cst.ClassDef)
    imports = (
        ctx.import_from("macrogen.runtime", "pipeline_class"),
        ctx.import_from("macrogen.runtime", "PipelineConfig"),
    )
    decorator, config = imports
    units, forward_var = _units(spec, site, ctx)
    plan = rendered_decorator(
        "pipeline_class.py.j2",
        name=spec.name,
        location=ctx.location(site.line),
        stages=spec.stages,
        microbatches=spec.microbatches,
        schedule=spec.schedule,
        split=spec.split,
        stages_per_rank=spec.stages_per_rank,
        cut=spec.cut,
        tied=spec.tied,
        decorator=decorator,
        config=config,
        forward=forward_var,
    )
    # the class object itself keeps its name and identity; forward's units come first (the
    # decorator names their Forward)
    blank = [cst.EmptyLine()] * (1 if site.scope else 2)  # PEP 8: one blank line inside a class
    cls = decorated(ctx, site.node, plan)
    # the first unit stands where the class stood (its leading lines), then the class
    unit = units[0]
    assert isinstance(unit, cst.FunctionDef)
    first = unit.with_changes(leading_lines=[*cls.leading_lines, *unit.leading_lines[len(blank) :]])
    return Expanded([first, *units[1:], cls.with_changes(leading_lines=blank)])


def _units(spec: Spec, site: Site, ctx: Context) -> tuple[list[cst.BaseStatement], str]:
    """forward's statements as functions (the user's lines, each marked with where it came
    from), and the ``Forward`` that lists them for the runtime."""
    a = spec.analysed
    assert a is not None
    qualname = f"{site.qualname}.forward"
    blank = [cst.EmptyLine()] * (1 if site.scope else 2)  # PEP 8
    statements: list[cst.BaseStatement] = []
    names = []
    for k, stmt in enumerate(a.forward.statements):
        name = ctx.names.fresh(f"_{spec.name}_forward_{k}")
        names.append(name)
        node = a.nodes[k]
        first = node.body[0] if stmt.loop is not None else node  # type: ignore[attr-defined]
        line = spec.forward_line + first.lineno - 1
        # the line map gives the copied lines the user's: the comment says where they start
        where = cst.Comment(f"# macrogen: {qualname} from {ctx.location(line)}")
        fn = cst.parse_statement(unit_function(a, k, name))
        statements.append(fn.with_changes(leading_lines=[*blank, cst.EmptyLine(comment=where)]))
    var = ctx.names.fresh(f"_{spec.name}_forward")
    described = render_statements(
        "pipeline_forward.py.j2",
        name=spec.name,
        var=var,
        forward=ctx.import_from("macrogen.runtime", "Forward"),
        statement=ctx.import_from("macrogen.runtime", "Statement"),
        params=a.forward.params,
        targets=a.forward.targets,
        statements=[
            dict(fn=n, index=s.index, reads=s.reads, writes=s.writes, parts=s.parts,
                 calls=s.calls, loop=s.loop)
            for n, s in zip(names, a.forward.statements)
        ],
    )  # fmt: skip
    described[0] = described[0].with_changes(leading_lines=blank)
    return [*statements, *described], var
