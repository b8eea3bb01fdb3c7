"""``node.visit(expander)`` for the pass's ``Expander``, without libcst's per-node machinery.

libcst's ``visit`` calls the transformer's ``on_visit``, then (if it says so) the
node's ``_visit_and_replace_children``, which visits every field (whitespace,
commas and parentheses included, each a ``visit`` with its own ``on_visit``,
``on_leave`` and type checks) and builds the node anew, then ``on_leave``. The
``Expander`` visits only the nodes that hold a name that may mean macrogen, and
leaves syntax leaves (``walk.leaf``) alone: ``on_visit`` refuses them and
``on_leave`` gives them back unchanged. So this walk skips the leaves, reads
the other fields in libcst's visiting order (``walk._fields``), calls the
attribute hooks the ``Expander`` has, and builds each visited node anew with
``with_changes``, as libcst does: the same calls, in the same order, on the
same nodes, and the same tree (``tests/test_pass_shortcuts.py`` compares the
two on the goldens; with ``fast.ENABLED = False`` the pass uses libcst's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import libcst as cst

from macrogen.expand import fast
from macrogen.expand.walk import _KIND, _NODE_FIELDS, _kind, _node_fields, leaf

_BODIES = (cst.Module, cst.IndentedBlock)  # their ``body`` drops statements left empty


def visit(node: cst.CSTNode, transformer: Any) -> Any:
    """What ``node.visit(transformer)`` returns, for a transformer that leaves leaves alone."""
    if not fast.ENABLED:
        return node.visit(transformer)
    return _visit(node, transformer, transformer.hooked_attributes())


def _visit(node: cst.CSTNode, t: Any, hooked: frozenset[str]) -> Any:
    if leaf(type(node)):
        return node
    updated = _children(node, t, hooked) if t.on_visit(node) else node
    return t.on_leave(node, updated)


def _children(node: cst.CSTNode, t: Any, hooked: frozenset[str]) -> cst.CSTNode:
    changes: dict[str, Any] = {}
    fields = _NODE_FIELDS.get(type(node))
    # (the other fields hold leaves: nothing to visit, no hook)
    for name in fields if fields is not None else _node_fields(node):
        if name in hooked:
            t.on_visit_attribute(node, name)
        value = getattr(node, name)
        kind = _KIND.get(type(value))
        if kind is None:
            kind = _kind(value)
        if kind == 1:
            new = _visit(value, t, hooked)
            if isinstance(new, cst.RemovalSentinel):  # (as libcst's visit_optional, _sentinel)
                how = _optional(node, name)
                if how is False:
                    raise TypeError(f"a {type(value).__name__} can't be removed here")
                new = None if how is None else cst.MaybeSentinel.DEFAULT
            elif isinstance(new, cst.FlattenSentinel):
                raise TypeError(f"a {type(value).__name__} can't be replaced by a sequence here")
            changes[name] = new
        elif kind == 2:
            changes[name] = tuple(_sequence(node, name, value, t, hooked))
        if name in hooked:
            t.on_leave_attribute(node, name)
    return rebuilt(node, changes)


_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


_Node = TypeVar("_Node", bound=cst.CSTNode)


def rebuilt(node: _Node, changes: dict[str, Any]) -> _Node:
    """``node.with_changes(**changes)`` (``dataclasses.replace``: a new node, validated),
    without scanning the node's dataclass fields at every call. ``changes`` is used up."""
    kind = type(node)
    names = _INIT_FIELDS.get(kind)
    if names is None:
        names = _INIT_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind) if f.init)
    for name in names:
        if name not in changes:
            changes[name] = getattr(node, name)
    new: _Node = kind(**changes)
    return new


def _sequence(node: cst.CSTNode, name: str, values: Any, t: Any, hooked: frozenset[str]) -> Any:
    body = name == "body" and isinstance(node, _BODIES)
    for child in values:
        if _kind(child) != 1:
            yield child
            continue
        new = _visit(child, t, hooked)
        if isinstance(new, cst.RemovalSentinel):
            continue
        for n in new.nodes if isinstance(new, cst.FlattenSentinel) else (new,):
            if body and not child._is_removable() and n._is_removable():
                continue  # (libcst's visit_body_iterable: a statement left empty goes)
            yield n


def _optional(node: cst.CSTNode, name: str) -> bool | None:
    """Whether libcst lets a removed child go: True (a MaybeSentinel field), None (an
    optional field), False (a required one), from the field's default."""
    default = node.__dataclass_fields__[name].default
    if default is None:
        return None
    return True if isinstance(default, cst.MaybeSentinel) else False
