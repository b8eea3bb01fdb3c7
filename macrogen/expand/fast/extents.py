"""The lines each statement of a libcst tree spans, and where its sites are, from ``ast``.

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
(``tests/test_layout.py`` compares the two on the goldens).

The same pairing gives ast's node for each expression a statement-form site can
be (a decorator, an ``if``'s test, a ``with`` item, a ``for``'s iterable, an
assignment's value): in a piece of plain ASCII, its position is libcst's.
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


class Paired:
    """What pairing a libcst tree with ast's gives: each statement's lines, and ast's node
    for each expression a statement-form site can be (``Pieces.site_range``)."""

    def __init__(self, offset: int):
        self.offset = offset  # ast's line numbers less this: lines counted from the piece's first
        self.extents: dict[cst.CSTNode, Extent] = {}
        self.sites: dict[cst.CSTNode, ast.expr] = {}


def ast_extents(
    statements: Sequence[cst.BaseStatement], nodes: Sequence[ast.stmt], first_line: int
) -> Paired | None:
    """Every statement at or below ``statements`` -> its (first, last) line, counted from
    ``first_line`` (as 1); ``nodes``: ast's statements of the same text. None: the trees differ."""
    paired = Paired(first_line - 1)
    try:
        _block(statements, nodes, paired)
    except _Mismatch:
        return None
    return paired


def _block(statements: Sequence[cst.BaseStatement], nodes: Sequence[ast.stmt], p: Paired) -> None:
    k = 0
    for s in statements:
        if isinstance(s, cst.SimpleStatementLine):  # its small statements: one ast statement each
            part = nodes[k : k + len(s.body)]
            if len(part) != len(s.body) or any(isinstance(p, _AST_COMPOUND) for p in part):
                raise _Mismatch
            p.extents[s] = (part[0].lineno - p.offset, max(_end(n) for n in part) - p.offset)
            k += len(part)
            small = s.body[0]
            if len(part) == 1 and isinstance(small, (cst.Assign, cst.AnnAssign)):
                value = getattr(part[0], "value", None)  # NAME = value: an assign site
                if small.value is not None and isinstance(value, ast.expr):
                    _site(p, small.value, value)
            continue
        kinds = _COMPOUND.get(type(s))
        if kinds is None or k >= len(nodes) or not isinstance(nodes[k], kinds):
            raise _Mismatch
        node = nodes[k]
        k += 1
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
        p.extents[s] = (first - p.offset, _end(node) - p.offset)
        _sites(s, node, p)
        _inner(s, node, p)
    if k != len(nodes):
        raise _Mismatch


def _sites(s: Any, node: Any, p: Paired) -> None:
    """ast's nodes of the expressions a compound statement's sites can be."""
    pairs: list[tuple[cst.CSTNode, ast.expr]] = []
    if isinstance(s, (cst.FunctionDef, cst.ClassDef)):
        if len(s.decorators) == len(node.decorator_list):
            pairs = list(zip((d.decorator for d in s.decorators), node.decorator_list))
    elif isinstance(s, cst.If):
        pairs = [(s.test, node.test)]
    elif isinstance(s, cst.For):
        pairs = [(s.iter, node.iter)]
    elif isinstance(s, cst.With) and len(s.items) == len(node.items):
        pairs = list(zip((i.item for i in s.items), (i.context_expr for i in node.items)))
    for expr, tree in pairs:
        _site(p, expr, tree)


def _site(p: Paired, expr: cst.CSTNode, tree: ast.expr) -> None:
    """A site is a macro call or names a macro (a bare decorator). ast's range of a tuple
    or a generator expression holds its parentheses, libcst's does not: those are left out."""
    if isinstance(tree, (ast.Call, ast.Attribute, ast.Name)):
        p.sites[expr] = tree


def _inner(s: Any, node: Any, p: Paired) -> None:
    """The blocks of a compound statement, paired with ast's."""
    if not isinstance(s, cst.Match):
        _suite(s.body, node.body, p)
    if isinstance(s, (cst.If, cst.For, cst.While, cst.Try, cst.TryStar)):
        orelse = s.orelse
        ast_orelse = node.orelse
        if isinstance(orelse, cst.If):  # elif: ast's orelse holds the If
            _block([orelse], ast_orelse, p)
        elif orelse is not None:
            _suite(orelse.body, ast_orelse, p)
        elif ast_orelse:
            raise _Mismatch
    if isinstance(s, (cst.Try, cst.TryStar)):
        handlers, own = node.handlers, list[Any](s.handlers)
        if len(own) != len(handlers):
            raise _Mismatch
        for h, a in zip(own, handlers):
            _suite(h.body, a.body, p)
        final = node.finalbody
        if s.finalbody is not None:
            _suite(s.finalbody.body, final, p)
        elif final:
            raise _Mismatch
    if isinstance(s, cst.Match):
        cases = node.cases
        if len(s.cases) != len(cases):
            raise _Mismatch
        for c, a in zip(s.cases, cases):
            _suite(c.body, a.body, p)


def _suite(suite: Any, nodes: Sequence[ast.stmt], p: Paired) -> None:
    if isinstance(suite, cst.IndentedBlock):
        _block(suite.body, nodes, p)
    elif not nodes:  # (a one-line suite holds small statements only: nothing to pair)
        raise _Mismatch


def _end(node: ast.stmt) -> int:
    return node.end_lineno if node.end_lineno is not None else node.lineno
