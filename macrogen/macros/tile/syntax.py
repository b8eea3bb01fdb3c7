"""Small questions about libcst nodes that @tile's analysis asks in several places."""

from __future__ import annotations

from typing import TypeGuard

import libcst as cst

from macrogen.macro import find


def other_operand(
    name: str, a: cst.BaseExpression, b: cst.BaseExpression
) -> cst.BaseExpression | None:
    if isinstance(a, cst.Name) and a.value == name:
        return b
    if isinstance(b, cst.Name) and b.value == name:
        return a
    return None


def is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def shape_read(node: cst.BaseExpression) -> tuple[cst.BaseExpression, int] | None:
    """(tensor, dim) of ``x.shape[d]``, ``x.size(d)`` or ``len(x)`` (d a non-negative integer)."""
    if (
        isinstance(node, cst.Subscript)
        and is_shape(node.value)
        and len(node.slice) == 1
        and isinstance(node.slice[0].slice, cst.Index)
        and isinstance(node.slice[0].slice.value, cst.Integer)
    ):
        return node.value.value, int(node.slice[0].slice.value.value)
    if isinstance(node, cst.Call) and len(node.args) == 1 and not node.args[0].keyword:
        arg = node.args[0].value
        if (
            isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "size"
            and isinstance(arg, cst.Integer)
        ):
            return node.func.value, int(arg.value)
        if isinstance(node.func, cst.Name) and node.func.value == "len":
            return arg, 0
    return None


def is_shape_subscript(node: cst.BaseExpression) -> bool:
    return shape_read(node) is not None


def is_shape(node: cst.BaseExpression) -> TypeGuard[cst.Attribute]:
    return isinstance(node, cst.Attribute) and node.attr.value == "shape"


def subscript_target(small: cst.BaseSmallStatement) -> cst.Subscript | None:
    target = (
        small.targets[0].target if isinstance(small, cst.Assign) else getattr(small, "target", None)
    )
    return target if isinstance(target, cst.Subscript) else None


def index_names(target: cst.Subscript | None) -> set[str]:
    """Every name that appears in the subscript (offsets included)."""
    if target is None:
        return set()
    return {node.value for el in target.slice for node in find(el, cst.Name)}


def suite(body: cst.BaseSuite) -> list[cst.BaseStatement]:
    """The statements of a block; ``for ...: a; b`` on one line is one line of them."""
    if isinstance(body, cst.IndentedBlock):
        return list(body.body)
    assert isinstance(body, cst.SimpleStatementSuite)
    return [cst.SimpleStatementLine(body.body)]


def tensor_of(target: cst.Subscript) -> str:
    """The tensor parameter a store writes (``_assignment`` checked it is a name)."""
    assert isinstance(target.value, cst.Name)
    return target.value.value
