"""Read-only walks over libcst trees, in libcst's order, without libcst's visitor machinery.

``node.visit(visitor)`` rebuilds (and re-validates) every node it passes, even
for a ``CSTVisitor`` that only reads: a macro's analysis (which attributes
``__init__`` assigns, where ``super`` is called, which names a loop reads)
would cost as much as a transform. These walks read the nodes' fields
instead, in the order libcst visits them (learnt once per node type from
libcst itself), so a walk that stops at the first match stops where
``visit`` would. Whitespace, comments and punctuation are not walked.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from typing import Any

import libcst as cst
from libcst import MaybeSentinel

# Syntax that holds no name or expression (whitespace, commas, brackets, operators).
_LEAVES = (
    cst.BaseParenthesizableWhitespace,
    cst.EmptyLine,
    cst.TrailingWhitespace,
    cst.Comment,
    cst.Newline,
    cst.Comma,
    cst.LeftParen,
    cst.RightParen,
    cst.LeftSquareBracket,
    cst.RightSquareBracket,
    cst.LeftCurlyBrace,
    cst.RightCurlyBrace,
    cst.BaseBinaryOp,
    cst.BaseBooleanOp,
    cst.BaseCompOp,
    cst.BaseUnaryOp,
    cst.BaseAugOp,
    cst.AssignEqual,
    cst.Colon,
    cst.Dot,
    cst.Semicolon,
    cst.ImportStar,
)

_FIELDS: dict[type, tuple[str, ...]] = {}  # node type -> its fields, in libcst's visiting order


class _Fields(cst.CSTVisitor):
    """Records the fields ``_visit_and_replace_children`` visits, in order, and descends nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return False

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if attribute not in self.order:
            self.order.append(attribute)


def _fields(node: cst.CSTNode) -> tuple[str, ...]:
    kind = type(node)
    order = _FIELDS.get(kind)
    if order is None:
        recorder = _Fields()
        node._visit_and_replace_children(recorder)
        order = _FIELDS[kind] = tuple(recorder.order)
    return order


_NODE_FIELDS: dict[type, tuple[str, ...]] = {}  # node type -> the fields that may hold a non-leaf


def _node_fields(node: cst.CSTNode) -> tuple[str, ...]:
    """``_fields`` less those whose declared type admits only leaves, strings and sentinels
    (whitespace, commas, parentheses: most of them), which ``children`` would read for nothing."""
    kind = type(node)
    found = _NODE_FIELDS.get(kind)
    if found is None:
        try:
            hints = typing.get_type_hints(kind)
        except Exception:  # pragma: no cover - an annotation typing can't resolve: read all
            hints = {}
        found = _NODE_FIELDS[kind] = tuple(
            name for name in _fields(node) if name not in hints or _may_hold_node(hints[name])
        )
    return found


def _may_hold_node(annotation: object) -> bool:
    """Whether a field of this declared type may hold a node that is not a leaf (when unsure: True)."""
    if annotation in (str, int, float, bool, type(None), MaybeSentinel):
        return False
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return False
    if origin is not None:  # Union, Optional, Sequence[...]
        return any(_may_hold_node(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, cst.CSTNode):
        return not issubclass(annotation, _LEAVES)
    return True


# What a field's value is, by its type: 1 a node to walk, 2 a sequence, 0 neither (a
# string, None, a leaf). Asked by type once: isinstance on libcst's abstract classes is slow.
_KIND: dict[type, int] = {}


def _kind(value: object) -> int:
    kind = type(value)
    found = _KIND.get(kind)
    if found is None:
        if issubclass(kind, cst.CSTNode):
            found = 0 if issubclass(kind, _LEAVES) else 1
        else:
            found = 2 if issubclass(kind, (list, tuple)) else 0
        _KIND[kind] = found
    return found


def leaf(kind: type) -> bool:
    """Whether nodes of this type are syntax that holds no name or expression."""
    found = _LEAF.get(kind)
    if found is None:
        found = _LEAF[kind] = issubclass(kind, _LEAVES)
    return found


_LEAF: dict[type, bool] = {}


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The node's children that are not leaves, in visiting order."""
    # (the pass's hottest loop: the caches are read inline, _kind called on a miss)
    children: list[cst.CSTNode] = []
    fields = _NODE_FIELDS.get(type(node))
    for name in fields if fields is not None else _node_fields(node):
        value = getattr(node, name)
        kind = _KIND.get(type(value))
        if kind is None:
            kind = _kind(value)
        if kind == 1:
            children.append(value)
        elif kind == 2:
            for v in value:
                k = _KIND.get(type(v))
                if k == 1 or (k is None and _kind(v) == 1):
                    children.append(v)
    return children


def nodes(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``root`` and every node below it, in the order ``root.visit`` meets them."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(children(node)))


def find(
    root: cst.CSTNode, kind: type[cst.CSTNode] | tuple[type[cst.CSTNode], ...]
) -> Iterator[Any]:
    """The nodes of ``kind`` at or below ``root``, in visiting order."""
    return (n for n in nodes(root) if _is(type(n), kind))


_IS: dict[tuple[type, Any], bool] = {}


def _is(node_type: type, kind: Any) -> bool:
    """``issubclass``, remembered: isinstance on libcst's classes (ABCs) runs Python code."""
    key = (node_type, kind)
    found = _IS.get(key)
    if found is None:
        found = _IS[key] = issubclass(node_type, kind)
    return found


class Visitor:
    """A read-only visitor for ``walk``: ``visit_<NodeType>(node)`` methods, as for libcst;
    one that returns False skips the node's children. No ``leave_`` methods."""


_METHODS: dict[tuple[type, type], Callable[[Any, Any], bool | None] | None] = {}


def walk(root: cst.CSTNode, visitor: Visitor) -> None:
    """``root.visit(visitor)`` for a visitor that only reads."""
    owner = type(visitor)
    stack = [root]
    while stack:
        node = stack.pop()
        key = (owner, type(node))
        try:
            visit = _METHODS[key]
        except KeyError:
            visit = _METHODS[key] = getattr(owner, f"visit_{type(node).__name__}", None)
        if visit is not None and visit(visitor, node) is False:
            continue
        stack.extend(reversed(children(node)))
