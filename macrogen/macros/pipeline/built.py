"""What a ``@pipeline`` class's ``__init__`` shows the macro (read with ``ast``): how many blocks
each looped-over ModuleList gets (``ModuleList(Block() for _ in range(N_LAYER))``), which
attributes hold no module (``self.config = config``), and which tensors two parts share
(``self.transformer.wte.weight = self.lm_head.weight``). What it does not show literally is
left to the run time.
"""

from __future__ import annotations

import ast

import libcst as cst

from macrogen.macro import Context
from macrogen.pipelining.analysis import self_path
from macrogen.pipelining.units import Forward


def _init(cls: cst.ClassDef) -> ast.FunctionDef | None:
    """__init__ as ``ast``, if the class defines one."""
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
            code = cst.Module([]).code_for_node(stmt.with_changes(decorators=(), leading_lines=()))
            fn = ast.parse(code).body[0]
            return fn if isinstance(fn, ast.FunctionDef) and fn.args.args else None
    return None


def _assigned(init: ast.FunctionDef) -> dict[str, ast.expr]:
    """``self.<path> = value`` in __init__, by path (the last assignment wins)."""
    me = init.args.args[0].arg
    found: dict[str, ast.expr] = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            path = self_path(node.targets[0], me)
            if path is not None:
                found[path] = node.value
    return found


def static_blocks(cls: cst.ClassDef, forward: Forward, ctx: Context) -> dict[str, int | None]:
    """How many blocks each looped-over ModuleList has, where __init__ shows it literally."""
    found: dict[str, int | None] = {loop: None for loop in forward.loops}
    init = _init(cls)
    if init is None:
        return found
    assigned = _assigned(init)
    for loop in found:
        value = _inside(assigned, loop)
        found[loop] = None if value is None else _count(value, ctx)
    return found


def _inside(assigned: dict[str, ast.expr], path: str) -> ast.expr | None:
    """The value built for ``transformer.h``: ``self.transformer = nn.ModuleDict(dict(h=...))``."""
    names = path.split(".")
    for k in range(len(names), 0, -1):
        value = assigned.get(".".join(names[:k]))
        if value is None:
            continue
        for name in names[k:]:
            value = _entry(value, name)
            if value is None:
                return None
        return value
    return None


def _entry(value: ast.expr, name: str) -> ast.expr | None:
    """``v`` of ``ModuleDict(dict(name=v))`` or ``ModuleDict({"name": v})``."""
    if not (isinstance(value, ast.Call) and len(value.args) == 1):
        return None
    func = value.func
    if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) != "ModuleDict":
        return None
    inner = value.args[0]
    if isinstance(inner, ast.Dict):
        for key, v in zip(inner.keys, inner.values):
            if isinstance(key, ast.Constant) and key.value == name:
                return v
    if isinstance(inner, ast.Call) and getattr(inner.func, "id", "") == "dict":
        for kw in inner.keywords:
            if kw.arg == name:
                return kw.value
    return None


def plain_attributes(cls: cst.ClassDef) -> frozenset[str]:
    """Attributes __init__ sets to no module (``self.config = config``): not parts to place."""
    init = _init(cls)
    if init is None:
        return frozenset()
    assigned = _assigned(init)
    return frozenset(p for p, v in assigned.items() if "." not in p and not isinstance(v, ast.Call))


def ties(cls: cst.ClassDef, placed: list[list[str]] | None) -> tuple[str, ...]:
    """``transformer.wte.weight = lm_head.weight``: a tensor __init__ makes two parts share,
    and the stages that hold it (``placed``: each stage's parts; None: cut at run time)."""
    init = _init(cls)
    if init is None:
        return ()
    me = init.args.args[0].arg
    ties = []
    for path, value in _assigned(init).items():
        source = self_path(value, me)
        if source is None or source.rpartition(".")[2] not in ("weight", "bias"):
            continue
        where = "each stage that uses it holds it, its gradients summed over them"
        if placed is not None:
            stages = [
                str(k)
                for k, parts in enumerate(placed)
                if any(t.startswith(q + ".") for q in parts for t in (path, source))
            ]
            if len(stages) > 1:
                names = f"{', '.join(stages[:-1])} and {stages[-1]}"
                where = f"stages {names} hold it, its gradients summed over them"
            else:
                where = "one stage holds it"
        ties.append(f"{path} = {source}: {where}")
    return tuple(ties)


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
