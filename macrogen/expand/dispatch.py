"""A transformer's ``visit_*``/``leave_*`` methods, looked up once per node type.

libcst's own dispatch formats a method name and looks it up for every node and every
attribute of every node; ``FastDispatch`` looks each up once per node type, and only for
the attributes its class has hooks for (``visit_FunctionDef_body``...). ``fast/drive.py``
walks the tree with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import libcst as cst

from macrogen.expand.walk import leaf

Dispatch = tuple[bool, bool, Callable[..., Any] | None, Callable[..., Any] | None]

_ATTRIBUTES: dict[type, frozenset[str]] = {}
_DISPATCH: dict[tuple[type, type], Dispatch] = {}
_METHODS: dict[tuple[type, str, type, str], Callable[..., Any] | None] = {}


class FastDispatch(cst.CSTTransformer):
    """The attribute hooks of a transformer, dispatched through the caches below."""

    def hooked_attributes(self) -> frozenset[str]:
        """The attributes of this class's ``visit_<Node>_<attribute>`` hooks (``drive.py``)."""
        return hooked_attributes(type(self))

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if attribute in hooked_attributes(type(self)):
            visit = method(type(self), "visit_", type(node), attribute)
            if visit is not None:
                visit(self, node)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        if attribute in hooked_attributes(type(self)):
            leave = method(type(self), "leave_", type(original_node), attribute)
            if leave is not None:
                leave(self, original_node)


def hooked_attributes(owner: type) -> frozenset[str]:
    """The attributes of ``owner``'s own ``visit_<Node>_<attribute>``/``leave_...`` hooks."""
    found = _ATTRIBUTES.get(owner)
    if found is None:
        found = _ATTRIBUTES[owner] = frozenset(
            name.split("_", 2)[2]
            for name in dir(owner)
            if name.startswith(("visit_", "leave_"))
            and name.count("_") >= 2
            and getattr(owner, name) is not getattr(cst.CSTTransformer, name, None)
        )
    return found


def dispatch(owner: type, kind: type) -> Dispatch:
    """For a node type: whether it is a statement, whether a leaf (``walk.leaf``), and
    ``owner``'s visit and leave methods for it; worked out once per type."""
    try:
        return _DISPATCH[owner, kind]
    except KeyError:
        found = _DISPATCH[owner, kind] = (
            issubclass(kind, cst.BaseStatement),
            leaf(kind),
            method(owner, "visit_", kind),
            method(owner, "leave_", kind),
        )
        return found


def method(owner: type, prefix: str, kind: type, attribute: str = "") -> Callable[..., Any] | None:
    """``owner``'s ``visit_If``, ``leave_FunctionDef_body``...: what libcst's dispatch finds;
    None where that is libcst's default (a visit that goes on, a leave that keeps the node)."""
    key = (owner, prefix, kind, attribute)
    try:
        return _METHODS[key]
    except KeyError:
        name = f"{prefix}{kind.__name__}" + (f"_{attribute}" if attribute else "")
        found = getattr(owner, name, None)
        if found is not None and found is getattr(cst.CSTTransformer, name, None):
            found = None
        _METHODS[key] = found
        return found
