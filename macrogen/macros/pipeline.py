"""``@pipeline(stages=2, ...)`` on an ``nn.Module`` class: its forward cut into pipeline stages.

    @mg.pipeline(stages=2, microbatches=4, schedule="1f1b", split=["blocks.2"])
    class GPT(nn.Module):                          # macrogen: pipeline at train.py:12
        def __init__(self, config): ...            class _GPT_serial(nn.Module):
        def forward(self, idx):              ->        ... (the user's class, unchanged)
            x = self.wte(idx)
            for block in self.blocks:              class GPT(_GPT_serial):
                x = block(x)                           # cut: stage 0: wte, blocks.0-1 | stage 1: ...
            return self.head(x)                        def __init__(self, *args, **kwargs):
                                                           super().__init__(*args, **kwargs)
                                                           attach(self, PipelineConfig(...), where=...)

    for x, y in data:                              # the loop's one pipeline line (serially:
        loss = mg.pipeline_step(model, x, y, F.cross_entropy)   # forward, loss, backward)
        opt.step()

The generated class builds the whole serial model (same initialization), then
``macrogen.runtime.pipeline`` keeps this rank's stage and runs torch's
``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``. Arguments (keyword
only): ``stages`` (required, >= 2), ``microbatches`` (4), ``schedule``
("1f1b" or "gpipe"), ``split`` (names that start stages 1.., e.g.
``["blocks.3"]``; without it the blocks of forward's ``nn.ModuleList`` loop
are balanced by parameter count at run time). ``microbatches``, ``schedule``
and ``split`` may be ``tunable``.

Expansion checks what the file shows: a forward that can't be split (naming
the statement), a split name forward doesn't call, more stages than a
literal number of blocks. The rest (world size, parameter counts) is
checked at run time.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.matchers as m

from macrogen import codegen
from macrogen.expand.args import Arg
from macrogen.expand.context import Context
from macrogen.expand.errors import InternalError, MacroError
from macrogen.expand.protocol import Expanded, Form, Site
from macrogen.runtime import pipeline_forward as pf

NAME = "pipeline"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = (
    "@pipeline(stages=2, microbatches=4, schedule='1f1b', split=['blocks.3'])"
    " decorates an nn.Module class whose forward is a sequence of submodule calls"
)
DEFAULTS: dict[str, Any] = {"stages": None, "microbatches": 4, "schedule": "1f1b", "split": None}
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Spec:
    name: str  # the user's class: the generated subclass takes it
    stages: int  # pipeline stages; world size = stages x data ranks
    microbatches: int  # per step
    schedule: str  # "1f1b" or "gpipe"
    split: tuple[str, ...] | None  # names that start stages 1..; None: balanced at run time
    cut: str  # where it cuts, for the generated docstring


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
    if "1f1b" in schedules and any(n < stages for n in microbatches):
        at = args.get("microbatches") or args.get("schedule")
        raise MacroError(
            f"1f1b needs at least as many micro-batches as stages ({stages}):"
            f" microbatches={min(microbatches)}",
            at.node if at else anchor,
        )
    _reject_named_super(node)
    forward_node = _forward(node)
    forward = _analyse(forward_node)
    blocks = _static_blocks(node, forward, ctx)
    splits = _choices(args, "split", ctx) if "split" in args else [None]
    cut = ""
    for split in splits:
        cut = _check_split(split, stages, forward, forward_node, blocks, args, anchor)
    value = args["split"].value if "split" in args else None
    return Spec(
        node.name.value,
        stages,
        args["microbatches"].value if "microbatches" in args else DEFAULTS["microbatches"],
        args["schedule"].value if "schedule" in args else DEFAULTS["schedule"],
        None if value is None else tuple(value),
        cut,
    )


def _choices(args: dict[str, Arg], name: str, ctx: Context) -> list[Any]:
    """The value, and every choice of a tunable (autotune may pick any of them)."""
    if name not in args:
        return [DEFAULTS[name]]
    arg = args[name]
    if arg.tunable is not None and arg.tunable in ctx.tunables:
        return list(ctx.tunables[arg.tunable].choices)
    return [arg.value]


def _reject_named_super(cls: cst.ClassDef) -> None:
    """``super(GPT, self)`` would name the generated subclass and recurse forever."""
    pattern = m.Call(func=m.Name("super"), args=[m.Arg(m.Name(cls.name.value)), m.AtLeastN(n=0)])
    for call in m.findall(cls.body, pattern):
        raise MacroError(
            f"write super() without arguments in a @pipeline class: super({cls.name.value}, ...)"
            " would name the generated pipelined subclass",
            call,
        )


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


def _analyse(fn: cst.FunctionDef) -> pf.Forward:
    code = cst.Module([]).code_for_node(fn.with_changes(decorators=(), leading_lines=()))
    try:
        return pf.parse(code)
    except pf.SplitError as e:
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


def _static_blocks(cls: cst.ClassDef, forward: pf.Forward, ctx: Context) -> dict[str, int | None]:
    """How many blocks each looped-over ModuleList has, where __init__ shows it literally."""
    found: dict[str, int | None] = {loop: None for loop in forward.loops}
    init = next(
        (s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"),
        None,
    )
    if init is None:
        return found
    code = cst.Module([]).code_for_node(init.with_changes(decorators=(), leading_lines=()))
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and target.attr in found
            ):
                found[target.attr] = _count(node.value, ctx)
    return found


def _count(value: ast.expr, ctx: Context) -> int | None:
    """3 for ``nn.ModuleList([a, b, c])``, N for ``ModuleList(B() for _ in range(N))``."""
    if not (isinstance(value, ast.Call) and len(value.args) == 1):
        return None
    name = (
        value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
    )
    if name not in ("ModuleList", "Sequential"):
        return None
    inner = value.args[0]
    if isinstance(inner, (ast.List, ast.Tuple)):
        return None if any(isinstance(e, ast.Starred) for e in inner.elts) else len(inner.elts)
    if isinstance(inner, (ast.ListComp, ast.GeneratorExp)) and len(inner.generators) == 1:
        gen = inner.generators[0]
        it = gen.iter
        if (
            not gen.ifs
            and isinstance(it, ast.Call)
            and isinstance(it.func, ast.Name)
            and it.func.id == "range"
            and len(it.args) == 1
        ):
            n = it.args[0]
            if isinstance(n, ast.Constant) and isinstance(n.value, int):
                return n.value
            if isinstance(n, ast.Name):
                constant = ctx.constants.get(n.id)
                if isinstance(constant, int):
                    return constant
    return None


def _check_split(
    split: Any,
    stages: int,
    forward: pf.Forward,
    fn: cst.FunctionDef,
    blocks: dict[str, int | None],
    args: dict[str, Arg],
    anchor: cst.CSTNode,
) -> str:
    """Check one split (or None) against forward; where it cuts, as the docstring says it."""
    loops = forward.loops
    if split is None:
        if not loops:
            raise MacroError(
                "without split=[...], @pipeline balances the blocks of a `for block in"
                " self.<ModuleList>:` loop in forward, and this forward has none: name the"
                f" submodules that start stages 1..{stages - 1} (split=[...])",
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
        return f"at run time, between blocks of self.{loops[0]}, balancing parameter counts"
    node = args["split"].node
    if not isinstance(split, (list, tuple)) or not all(isinstance(s, str) for s in split):
        raise MacroError(
            f"split must be a list of submodule names ('blocks.3'), not {split!r}", node
        )
    if len(split) != stages - 1:
        raise MacroError(pf.split_count_message(stages, len(split)), node)
    counts: dict[str, int] = {}
    for lp in loops:
        wanted = [int(s.split(".", 1)[1]) for s in split if _block_of(s, lp) is not None]
        known = blocks[lp]
        counts[lp] = known if known is not None else max([1, *wanted]) + 1
    units = forward.units(counts)
    for k, name in enumerate(split):
        el = _element(node, k)
        if not any(_names(u, name) for u in units):
            raise MacroError(pf.unknown_split_message(forward, units, name), el)
    try:
        starts = pf.resolve_split(forward, units, list(split))
    except pf.SplitError as e:
        raise MacroError(e.message, node) from None
    _cuts(forward, fn, units, starts, list(split), node)
    edges = [0, *starts, len(units)]
    open_ended = {lp for lp in loops if blocks[lp] is None}
    described = []
    for s in range(stages):
        parts = [p for u in units[edges[s] : edges[s + 1]] for p in u.parts]
        text = pf.runs(parts)
        for lp in open_ended:  # the last block is the run time's: "blocks.3-"
            text = text.replace(f"{lp}.{counts[lp] - 1}", f"{lp}.{counts[lp] - 1}..")
        described.append(f"stage {s}: {text}")
    return " | ".join(described)


def _block_of(name: str, loop: str) -> int | None:
    head, _, tail = name.partition(".")
    return int(tail) if head == loop and tail.isdigit() else None


def _names(unit: pf.Unit, name: str) -> bool:
    return unit.name == name if unit.block is not None else name in unit.statement.calls


def _cuts(
    forward: pf.Forward,
    fn: cst.FunctionDef,
    units: list[pf.Unit],
    starts: list[int],
    names: list[str] | None,
    anchor: cst.CSTNode,
) -> None:
    try:
        pf.check_cuts(forward, units, starts, names)
    except pf.SplitError as e:
        raise MacroError(e.message, _statement(fn, e.path) if e.path else anchor) from None


def _element(node: cst.BaseExpression, k: int) -> cst.CSTNode:
    if isinstance(node, (cst.List, cst.Tuple)) and k < len(node.elements):
        return node.elements[k].value
    return node


# -- expansion ----------------------------------------------------------------------------


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    if not re.fullmatch(r"[\w.,:|()\- ]*", spec.cut):  # it goes into a comment: names only
        raise InternalError(f"pipeline: unexpected text in the cut description {spec.cut!r}")
    assert isinstance(site.node, cst.ClassDef)
    serial = ctx.names.fresh(f"_{spec.name}_serial")
    runtime = "macrogen.runtime.pipeline"
    imports = (
        ctx.import_from(runtime, "attach"),
        ctx.import_from(runtime, "PipelineConfig"),
        ctx.import_from(runtime, "full_state_dict"),
        ctx.import_from(runtime, "load_full_state_dict"),
    )
    attach, config, gather, scatter = imports
    generated = codegen.render_statements(
        "pipeline_class.py.j2",
        name=spec.name,
        serial=serial,
        location=ctx.location(site.line),
        stages=spec.stages,
        microbatches=spec.microbatches,
        schedule=spec.schedule,
        split=spec.split,
        cut=spec.cut,
        attach=attach,
        config=config,
        gather=gather,
        scatter=scatter,
    )
    blank = [cst.EmptyLine()] * (1 if site.scope else 2)  # PEP 8: one blank line inside a class
    generated[0] = generated[0].with_changes(leading_lines=blank)
    return Expanded([site.node.with_changes(name=cst.Name(serial)), *generated], imports=imports)
