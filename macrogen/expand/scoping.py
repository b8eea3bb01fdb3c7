"""The scopes a transformer walks through: defs, classes, lambdas and comprehensions.

``ScopeTracking`` keeps ``scopes`` (``sites.ScopeStack``) in step with the walk, so that a
site sees which names are bound where it stands (``mg`` may be a local variable). A local
import of macrogen makes its names hot below it (``HotLines``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import libcst as cst

from macrogen.expand.dispatch import FastDispatch
from macrogen.expand.errors import MacroError
from macrogen.expand.sites import (
    Comprehension,
    Scope,
    ScopeStack,
    collect_scope,
    comprehension_scope,
    nfkc,
)
from macrogen.expand.walk import children


class HotLines(Protocol):
    """Which statements mention a name that may mean macrogen (``expand/__init__.py``)."""

    names: set[str]

    def __call__(self, node: cst.CSTNode) -> bool: ...

    def add(self, names: Iterable[str]) -> None: ...


def live_nodes(root: cst.CSTNode, hot: HotLines) -> set[int]:
    """The ids of the nodes at or below ``root`` that hold a ``Name`` in ``hot.names``,
    not looking into the statements ``hot`` rules out (they are not visited)."""
    live: set[int] = set()
    _mark(root, root, hot, live)
    return live


def _mark(node: cst.CSTNode, root: cst.CSTNode, hot: HotLines, live: set[int]) -> bool:
    # (a function of its own, not a closure: a closure that calls itself is a reference
    # cycle, which would keep the tree alive until the cycle collector runs)
    kind = type(node)
    statement = _STATEMENTS.get(kind)
    if statement is None:  # (cached: BaseStatement is an ABC, its isinstance is slow)
        statement = _STATEMENTS[kind] = issubclass(kind, cst.BaseStatement)
    if statement and node is not root and not hot(node):
        return False
    found = kind is cst.Name and nfkc(node.value) in hot.names  # type: ignore[attr-defined]
    for child in children(node):
        if _mark(child, root, hot, live):
            found = True
    if found:
        live.add(id(node))
    return found


_STATEMENTS: dict[type, bool] = {}  # node type -> whether a statement


class ScopeTracking(FastDispatch):
    scopes: ScopeStack
    hot: HotLines | None
    live: set[int] | None
    errors: list[MacroError]
    outermost: set[cst.CompFor]  # the comprehensions' first for, being visited
    suspended: list[Scope]  # comprehension scopes left while their first iterable is

    def _push(self, scope: Scope) -> None:
        self.scopes.push(scope)
        if self.hot is not None and scope.macros:
            self.hot.add(scope.macros)  # a local import of macrogen: its names are hot below
            self.live = None  # (found with the names before: visit everything from here)

    def _scope(
        self, kind: str, node: cst.FunctionDef | cst.ClassDef, parts: list[cst.CSTNode]
    ) -> Scope:
        """The names a def or class binds. Only worth collecting when a statement of its
        block mentions a name that may mean macrogen: no other is visited, so nothing in
        the block asks (a @tile kernel's loops, a @tensor_parallel class's methods)."""
        body = node.body
        if (
            self.hot is not None
            and isinstance(body, cst.IndentedBlock)
            and not any(map(self.hot, body.body))
        ):
            return Scope(kind, node.name.value)
        return collect_scope(kind, node.name.value, parts, self.errors)

    def visit_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self._push(self._scope("function", node, [node.params, node.body]))

    def leave_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_ClassDef_body(self, node: cst.ClassDef) -> None:
        self._push(self._scope("class", node, [node.body]))

    def leave_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self._push(collect_scope("function", "<lambda>", [node.params], self.errors))

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.scopes.pop()

    # A comprehension's for names are its own scope's, around all of it but the
    # outermost iterable, which Python evaluates outside (``[mg for mg in mg.x]``).
    def _enter_comprehension(self, node: Comprehension, whole: bool) -> None:
        if whole:
            self.outermost.add(node.for_in)
        self._push(comprehension_scope(node))

    def _leave_comprehension(self, node: Comprehension, whole: bool) -> None:
        if whole:
            self.outermost.discard(node.for_in)
        self.scopes.pop()

    def visit_CompFor_iter(self, node: cst.CompFor) -> None:
        if node in self.outermost:
            self.suspended.append(self.scopes.stack.pop())

    def leave_CompFor_iter(self, node: cst.CompFor) -> None:
        if node in self.outermost:
            self.scopes.push(self.suspended.pop())

    def visit_ListComp_elt(self, node: cst.ListComp) -> None:
        self._enter_comprehension(node, False)

    def leave_ListComp_elt(self, node: cst.ListComp) -> None:
        self._leave_comprehension(node, False)

    def visit_ListComp_for_in(self, node: cst.ListComp) -> None:
        self._enter_comprehension(node, True)

    def leave_ListComp_for_in(self, node: cst.ListComp) -> None:
        self._leave_comprehension(node, True)

    def visit_SetComp_elt(self, node: cst.SetComp) -> None:
        self._enter_comprehension(node, False)

    def leave_SetComp_elt(self, node: cst.SetComp) -> None:
        self._leave_comprehension(node, False)

    def visit_SetComp_for_in(self, node: cst.SetComp) -> None:
        self._enter_comprehension(node, True)

    def leave_SetComp_for_in(self, node: cst.SetComp) -> None:
        self._leave_comprehension(node, True)

    def visit_GeneratorExp_elt(self, node: cst.GeneratorExp) -> None:
        self._enter_comprehension(node, False)

    def leave_GeneratorExp_elt(self, node: cst.GeneratorExp) -> None:
        self._leave_comprehension(node, False)

    def visit_GeneratorExp_for_in(self, node: cst.GeneratorExp) -> None:
        self._enter_comprehension(node, True)

    def leave_GeneratorExp_for_in(self, node: cst.GeneratorExp) -> None:
        self._leave_comprehension(node, True)

    def visit_DictComp_key(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, False)

    def leave_DictComp_key(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, False)

    def visit_DictComp_value(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, False)

    def leave_DictComp_value(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, False)

    def visit_DictComp_for_in(self, node: cst.DictComp) -> None:
        self._enter_comprehension(node, True)

    def leave_DictComp_for_in(self, node: cst.DictComp) -> None:
        self._leave_comprehension(node, True)
