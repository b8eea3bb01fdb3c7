"""forward's source as units: which statements, what each reads and writes, where it can't be cut.

Pure ``ast``: the result is ``macrogen.pipelining.units.Forward`` (the data the
generated code hands the runtime), plus what the macro's errors and code
generation need (each statement's node). The ``@pipeline`` macro runs it at
expansion; ``mg.parallelize(pp=N)`` at run time, on a built model's forward
(``macrogen/runtime/parallelize_pipeline.py``).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

from macrogen.pipelining.units import SUPPORTED, Forward, SplitError, Statement


@dataclass(frozen=True)
class Analysed:
    forward: Forward
    source: str  # forward's code, ``def`` on line 1
    node: ast.FunctionDef
    self_name: str
    nodes: tuple[ast.stmt, ...]  # each statement's node, as forward.statements
    inner: tuple[frozenset[str], ...]  # self.<path>(...) called anywhere in each, nested too


def parse(source: str) -> Analysed:
    """Analyse forward's source (a ``def forward(self, ...)``, indented or not)."""
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    fn = tree.body[0] if tree.body else None
    if isinstance(fn, ast.AsyncFunctionDef):
        raise SplitError("forward is async: a pipeline stage runs a plain forward")
    if not isinstance(fn, ast.FunctionDef):
        raise SplitError("expected a forward method")
    return analyse(fn, source)


def analyse(fn: ast.FunctionDef, source: str = "") -> Analysed:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if not positional:
        raise SplitError("forward takes no self")
    me = positional[0].arg
    body = list(fn.body)
    first = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        first = 1  # a docstring is no unit
    for i, stmt in enumerate(body[first:], start=first):
        _check(i, stmt, me, i == len(body) - 1)
    nodes = body[first:]
    if not nodes or not isinstance(nodes[-1], ast.Return):
        raise SplitError(
            "forward must end with `return <output>`: the last stage's output goes to the loss"
            f" (supported: {SUPPORTED})",
            (len(body) - 1,) if body else (),
        )
    params = tuple(a.arg for a in [*positional[1:], *args.kwonlyargs])
    # defaults belong to the last positional parameters: the second has one if enough do
    with_default = len(positional) > 2 and len(args.defaults) >= len(positional) - 2
    targets = positional[2].arg if with_default else None
    statements = _statements(nodes, range(first, len(body)), me, params)
    inner = tuple(_called(n, me) for n in nodes)
    forward = Forward(params, statements, targets)
    return Analysed(forward, source, fn, me, tuple(nodes), inner)


def _check(i: int, stmt: ast.stmt, me: str, last: bool) -> None:
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
            raise SplitError(f"{bad} (supported: {SUPPORTED})", (i,))
    loop = module_list_loop(stmt, me)
    if loop is not None:
        for j, inner in enumerate(stmt.body):  # type: ignore[attr-defined]
            for node in ast.walk(inner):
                if isinstance(node, (ast.Break, ast.Continue)):
                    raise SplitError(
                        f"break/continue in the loop over self.{loop}: every block must run"
                        f" (supported: {SUPPORTED})",
                        (i, j),
                    )


def _statements(
    nodes: list[ast.stmt], indices: range, me: str, params: tuple[str, ...]
) -> tuple[Statement, ...]:
    """Each statement with the local names it reads and the ones later statements need."""
    scanned = []
    for stmt in nodes:
        loop = module_list_loop(stmt, me)
        code = stmt.body if loop is not None else [stmt]  # type: ignore[attr-defined]
        exposed, assigned = _names(code)
        if loop is not None:
            target = stmt.target.id  # type: ignore[attr-defined]
            exposed, assigned = [n for n in exposed if n != target], assigned | {target}
        scanned.append((stmt, loop, exposed, assigned))
    out: list[Statement] = []
    defined = set(params)
    reads_of: list[list[str]] = []
    for _, _, exposed, assigned in scanned:
        reads_of.append([n for n in exposed if n in defined])
        defined |= assigned
    for k, (stmt, loop, _, assigned) in enumerate(scanned):
        later = {n for r in reads_of[k + 1 :] for n in r} | (set(reads_of[k]) if loop else set())
        last = k == len(scanned) - 1
        writes = () if last else tuple(sorted(assigned & later))
        found = sorted(
            (getattr(n, "lineno", 0), getattr(n, "col_offset", 0), a) for n, a in _paths(stmt, me)
        )
        parts = tuple(dict.fromkeys(a for _, _, a in found if a != loop))
        calls = tuple(sorted(_called(stmt, me))) if isinstance(stmt, _SIMPLE) else ()
        out.append(Statement(None, indices[k], tuple(reads_of[k]), writes, parts, calls, loop))
    return tuple(out)


_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)


def module_list_loop(stmt: ast.stmt, me: str) -> str | None:
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


# -- where values live ---------------------------------------------------------------

_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
           ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # fmt: skip


def _names(nodes: list[ast.stmt]) -> tuple[list[str], set[str]]:
    """(local names read before this code assigns them, in order; names it assigns).

    Names bound inside a lambda or comprehension are that scope's, not forward's.
    """
    exposed: list[str] = []
    assigned: set[str] = set()
    for stmt in nodes:
        reads: list[str] = []
        writes: set[str] = set()
        _scan(stmt, reads, writes, frozenset())
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            reads.append(stmt.target.id)
        for n in reads:
            if n not in assigned and n not in exposed:
                exposed.append(n)
        assigned |= writes
    return exposed, assigned


def _scan(node: ast.AST, reads: list[str], writes: set[str] | None, bound: frozenset[str]) -> None:
    """Collect reads (not of ``bound`` names) and, in forward's own scope, writes."""
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load):
            if node.id not in bound:
                reads.append(node.id)
        elif writes is not None:
            writes.add(node.id)
        return
    if isinstance(node, _SCOPES):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and writes is not None
        ):
            writes.add(node.name)
        inner = set(bound)
        for sub in ast.walk(node):
            if isinstance(sub, ast.arg):
                inner.add(sub.arg)
            elif isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
                inner.add(sub.id)
        for child in ast.iter_child_nodes(node):
            _scan(child, reads, None, frozenset(inner))
        return
    for child in ast.iter_child_nodes(node):
        _scan(child, reads, writes, bound)
