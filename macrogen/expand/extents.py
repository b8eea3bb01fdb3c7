"""The lines each statement of a libcst tree spans, from ``ast``'s positions of the same text.

The pass visits only the statements whose lines mention a name that may mean
macrogen (``expansion._HotLines``). It used to learn those lines from a codegen
of every statement it parsed; ``ast`` already has them. The two trees have the
same statements in the same order (libcst's ``a; b`` line is ast's two
statements), so walking them side by side pairs each libcst statement with its
ast ones. Any difference in shape returns None, and the caller asks the codegen.

An ast extent runs from a statement's first line of code (its first decorator)
to its last: the comment lines libcst counts as a statement's leading lines are
left out. No name is in a comment, so a statement those lines alone would make
"hot" holds no site: leaving it unvisited changes nothing
(``tests/test_pass_shortcuts.py`` compares the two on the goldens).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

import libcst as cst

_COMPOUND: dict[type, tuple[type, ...]] = {
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef),
    cst.ClassDef: (ast.ClassDef,),
    cst.If: (ast.If,),
    cst.For: (ast.For, ast.AsyncFor),
    cst.While: (ast.While,),
    cst.Try: (ast.Try,),
    cst.TryStar: (getattr(ast, "TryStar", ast.Try),),  # (Python 3.11)
    cst.With: (ast.With, ast.AsyncWith),
    cst.Match: (ast.Match,),
}
_AST_COMPOUND = tuple(t for kinds in _COMPOUND.values() for t in kinds)

Extent = tuple[int, int]


class _Mismatch(Exception):
    pass


def ast_extents(
    statements: Sequence[cst.BaseStatement], nodes: Sequence[ast.stmt], first_line: int
) -> dict[cst.CSTNode, Extent] | None:
    """Every statement at or below ``statements`` -> its (first, last) line, counted from
    ``first_line`` (as 1); ``nodes``: ast's statements of the same text. None: the trees differ."""
    out: dict[cst.CSTNode, Extent] = {}
    try:
        _block(statements, nodes, out, first_line - 1)
    except _Mismatch:
        return None
    return out


def _block(
    statements: Sequence[cst.BaseStatement],
    nodes: Sequence[ast.stmt],
    out: dict[cst.CSTNode, Extent],
    offset: int,
) -> None:
    k = 0
    for s in statements:
        if isinstance(s, cst.SimpleStatementLine):  # its small statements: one ast statement each
            part = nodes[k : k + len(s.body)]
            if len(part) != len(s.body) or any(isinstance(p, _AST_COMPOUND) for p in part):
                raise _Mismatch
            out[s] = (part[0].lineno - offset, max(_end(p) for p in part) - offset)
            k += len(part)
            continue
        kinds = _COMPOUND.get(type(s))
        if kinds is None or k >= len(nodes) or not isinstance(nodes[k], kinds):
            raise _Mismatch
        node = nodes[k]
        k += 1
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
        out[s] = (first - offset, _end(node) - offset)
        _inner(s, node, out, offset)
    if k != len(nodes):
        raise _Mismatch


def _inner(s: Any, node: Any, out: dict[cst.CSTNode, Extent], offset: int) -> None:
    """The blocks of a compound statement, paired with ast's."""
    if not isinstance(s, cst.Match):
        _suite(s.body, node.body, out, offset)
    if isinstance(s, (cst.If, cst.For, cst.While, cst.Try, cst.TryStar)):
        orelse = s.orelse
        ast_orelse = node.orelse
        if isinstance(orelse, cst.If):  # elif: ast's orelse holds the If
            _block([orelse], ast_orelse, out, offset)
        elif orelse is not None:
            _suite(orelse.body, ast_orelse, out, offset)
        elif ast_orelse:
            raise _Mismatch
    if isinstance(s, (cst.Try, cst.TryStar)):
        handlers, own = node.handlers, list[Any](s.handlers)
        if len(own) != len(handlers):
            raise _Mismatch
        for h, a in zip(own, handlers):
            _suite(h.body, a.body, out, offset)
        final = node.finalbody
        if s.finalbody is not None:
            _suite(s.finalbody.body, final, out, offset)
        elif final:
            raise _Mismatch
    if isinstance(s, cst.Match):
        cases = node.cases
        if len(s.cases) != len(cases):
            raise _Mismatch
        for c, a in zip(s.cases, cases):
            _suite(c.body, a.body, out, offset)


def _suite(
    suite: Any, nodes: Sequence[ast.stmt], out: dict[cst.CSTNode, Extent], offset: int
) -> None:
    if isinstance(suite, cst.IndentedBlock):
        _block(suite.body, nodes, out, offset)
    elif not nodes:  # (a one-line suite holds small statements only: nothing to pair)
        raise _Mismatch


def _end(node: ast.stmt) -> int:
    return node.end_lineno if node.end_lineno is not None else node.lineno
