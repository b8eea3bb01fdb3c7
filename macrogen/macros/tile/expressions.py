"""How ``@tile`` reads expressions: loads, arithmetic and calls into IR nodes (ir.py).

``ExpressionReader`` is the expression half of the analysis in
analysis.py; it reads the analysis' tables of what names mean (``params``,
``sizes``, ``ndim``, ``scalars``, ``loop_vars``, ``outputs``, ``constants``)
and records tensors and scalars as it meets them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import libcst as cst

from macrogen.macro import MacroError, evaluated, find
from macrogen.macros.tile.ir import (
    Binary,
    Call,
    Const,
    Expr,
    Index,
    Load,
    Loop,
    Name,
    Size,
    Unary,
    Var,
)

_UNARY_FUNCTIONS = ("exp", "log", "sqrt", "tanh", "sigmoid", "abs")
_TORCH_FUNCTIONS = {f: f for f in (*_UNARY_FUNCTIONS, "where")} | {
    "maximum": "max",
    "minimum": "min",
}
_BUILTINS = {"max": "max", "min": "min", "abs": "abs"}
_BINARY = {
    cst.Add: "+",
    cst.Subtract: "-",
    cst.Multiply: "*",
    cst.Divide: "/",
    cst.BitAnd: "&",
    cst.BitOr: "|",
}
_COMPARE = {
    cst.LessThan: "<",
    cst.LessThanEqual: "<=",
    cst.GreaterThan: ">",
    cst.GreaterThanEqual: ">=",
    cst.Equal: "==",
    cst.NotEqual: "!=",
}
SUPPORTED = (
    "supported: + - * / ** (integer power 2-4), comparisons, & |, min/max,"
    " torch.exp/log/sqrt/tanh/sigmoid/abs/where/maximum/minimum"
)


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


class Scope:
    """What names mean at one point of the nest."""

    def __init__(self, loop_vars: tuple[str, ...], local: dict[str, Expr]):
        self.loop_vars = loop_vars  # usable as indices here
        self.local = local  # name -> a Name expression with its dims
        self.carried: set[str] = set()  # accumulators of the inner loop we are in
        self.gone: dict[str, str] = {}  # names that went out of scope -> why


class ExpressionReader:
    """Expressions of one @tile function (mixed into the analysis, which owns the tables)."""

    params: tuple[str, ...]
    sizes: dict[str, Size]
    ndim: dict[str, int]  # tensor parameter -> number of indices
    scalars: list[str]
    loop_vars: set[str]
    outputs: set[str]
    index_tensors: set[str]
    value_tensors: set[str]
    constants: Mapping[str, Any]
    loops: dict[str, Loop]  # loop variable -> the loop that binds it where it is read

    def _index_in_range(
        self, subscript: cst.Subscript, dim: int, index: Index, node: cst.CSTNode
    ) -> None:
        """Refuse an index the analysis can tell leaves its dimension (the analysis knows the
        loops' ranges and the sizes)."""
        raise NotImplementedError

    def _use_tensor(self, tensor: str, ndim: int, node: cst.CSTNode) -> None:
        """Record ``tensor``'s rank (the analysis checks it against its other uses)."""
        raise NotImplementedError

    def _expr(self, node: cst.BaseExpression, scope: Scope) -> Expr:
        if isinstance(node, (cst.Integer, cst.Float)):
            return Const(frozenset(), False, evaluated(node))
        if isinstance(node, cst.Name):
            return self._name(node, scope)
        if isinstance(node, cst.Attribute):
            if code_of(node) in ("math.inf", "torch.inf"):
                return Const(frozenset(), False, math.inf)
            if code_of(node) in ("math.pi", "torch.pi"):
                return Const(frozenset(), False, math.pi)
            raise MacroError(f"{code_of(node)} is not supported in @tile; {SUPPORTED}", node)
        if isinstance(node, cst.UnaryOperation):
            if isinstance(node.operator, (cst.Minus, cst.Plus)):
                operand = self._expr(node.expression, scope)
                if isinstance(node.operator, cst.Plus):
                    return operand
                return negate(operand)
            raise MacroError(
                f"operator {code_of(node.operator).strip()} is not supported; {SUPPORTED}", node
            )
        if isinstance(node, cst.BinaryOperation):
            if isinstance(node.operator, cst.Power):
                base = self._expr(node.left, scope)
                if not (isinstance(node.right, cst.Integer) and 2 <= int(node.right.value) <= 4):
                    raise MacroError("** takes an integer power 2, 3 or 4 in @tile", node.right)
                return Binary(
                    base.dims,
                    base.tensor,
                    "**",
                    base,
                    Const(frozenset(), False, int(node.right.value)),
                )
            op = _BINARY.get(type(node.operator))
            if op is None:
                raise MacroError(
                    f"operator {code_of(node.operator).strip()} is not supported; {SUPPORTED}",
                    node.operator,
                )
            return self._binary(op, self._expr(node.left, scope), self._expr(node.right, scope))
        if isinstance(node, cst.Comparison):
            if len(node.comparisons) != 1 or type(node.comparisons[0].operator) not in _COMPARE:
                raise MacroError(
                    "write one comparison at a time (a < b), combined with & or |", node
                )
            comp = node.comparisons[0]
            return self._binary(
                _COMPARE[type(comp.operator)],
                self._expr(node.left, scope),
                self._expr(comp.comparator, scope),
            )
        if isinstance(node, cst.Call):
            return self._call(node, scope)
        if isinstance(node, cst.Subscript):
            return self._load(node, scope)
        if isinstance(node, cst.BooleanOperation):
            raise MacroError(
                "and/or are not supported on tensors; use & and | on comparisons", node
            )
        if isinstance(node, cst.IfExp):
            raise MacroError(
                "conditional expressions are not supported; use torch.where(cond, a, b)", node
            )
        raise MacroError(
            f"{type(node).__name__} is not supported in an @tile expression; {SUPPORTED}", node
        )

    def _name(self, node: cst.Name, scope: Scope) -> Expr:
        name = node.value
        if name in scope.carried:
            raise MacroError(
                f"{name!r} is read inside the loop that reduces into it: a loop-carried dependence"
                " (only reductions are supported; read it after the loop)",
                node,
            )
        if name in scope.local:
            return scope.local[name]
        if name in scope.loop_vars:
            return Var(frozenset((name,)), True, name)
        if name in scope.gone:
            raise MacroError(scope.gone[name], node)
        if name in self.loop_vars:
            raise MacroError(f"loop variable {name!r} is not defined here", node)
        if name in self.sizes:
            return Name(frozenset(), False, name)
        if name in self.params:
            if name in self.ndim:
                raise MacroError(f"tensor {name!r} must be indexed: {name}[...]", node)
            if name not in self.scalars:
                self.scalars.append(name)
            return Name(frozenset(), False, name)
        value = self.constants.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Const(frozenset(), False, value)
        raise MacroError(
            f"{name!r} is not a parameter, size, local or define()d number of this @tile function",
            node,
        )

    def _function_name(self, func: cst.BaseExpression) -> str | None:
        text = code_of(func)
        if text in _BUILTINS:
            return _BUILTINS[text]
        if text.startswith("torch.") and text[6:] in _TORCH_FUNCTIONS:
            return _TORCH_FUNCTIONS[text[6:]]
        return None

    def _call(self, node: cst.Call, scope: Scope) -> Expr:
        text = code_of(node.func)
        if (
            text == "float"
            and len(node.args) == 1
            and isinstance(node.args[0].value, cst.SimpleString)
        ):
            value = evaluated(node.args[0].value)
            if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf"):
                return Const(frozenset(), False, float(value))
        fn = self._function_name(node.func)
        if fn is None:
            raise MacroError(f"unknown call {text}(...) in @tile; {SUPPORTED}", node.func)
        if any(a.keyword is not None or a.star for a in node.args):
            raise MacroError(f"{text}() takes positional arguments here", node)
        want = 3 if fn == "where" else 2 if fn in ("max", "min") else 1
        if len(node.args) != want:
            raise MacroError(f"{text}() takes {want} argument(s) here", node)
        args = tuple(self._expr(a.value, scope) for a in node.args)
        if (
            fn in ("max", "min")
            and not any(a.tensor for a in args)
            and all(isinstance(a, Const) for a in args)
        ):
            pick = max if fn == "max" else min
            return Const(frozenset(), False, pick(a.value for a in args))  # type: ignore[attr-defined]
        dims = frozenset().union(*(a.dims for a in args))
        return Call(dims, any(a.tensor for a in args), fn, args)

    def _load(self, node: cst.Subscript, scope: Scope, as_index: bool = False) -> Load:
        if not isinstance(node.value, cst.Name) or node.value.value not in self.params:
            raise MacroError("only tensor parameters can be indexed in @tile", node.value)
        tensor = node.value.value
        if tensor in self.outputs:
            raise MacroError(
                f"{tensor!r} is written by this loop nest, so reading it is not supported"
                f" (tiles would race); use {tensor}[...] += ... to accumulate",
                node,
            )
        kinds = (self.index_tensors, self.value_tensors)
        mine, other = kinds if as_index else kinds[::-1]
        if tensor in other:
            raise MacroError(
                f"{tensor!r} is read both as an index (integers) and as a value here; use two tensors",
                node,
            )
        mine.add(tensor)
        index = []
        for dim, el in enumerate(node.slice):
            index.append(self._index(el, scope, nested=as_index))
            self._index_in_range(node, dim, index[-1], el)
        used = [i.var for i in index if i.var is not None]
        if len(set(used)) != len(used):
            raise MacroError("a loop variable may index only one dimension of a load", node)
        self._use_tensor(tensor, len(index), node)
        dims = frozenset(used).union(*(i.gather.dims for i in index if i.gather is not None))
        return Load(dims, True, tensor, tuple(index))

    def _index(self, el: cst.SubscriptElement, scope: Scope, nested: bool = False) -> Index:
        usage = (
            "a tensor index is a loop variable, optionally +- an integer constant,"
            " or a non-negative integer"
        )
        sl = el.slice
        if not isinstance(sl, cst.Index):
            raise MacroError(f"slices are not supported; {usage}", el)
        v = sl.value
        if isinstance(v, cst.Integer):
            return Index(None, int(v.value))
        if isinstance(v, cst.Name) and v.value in scope.loop_vars:
            return Index(v.value, 0)
        if isinstance(v, cst.BinaryOperation) and isinstance(v.operator, (cst.Add, cst.Subtract)):
            var, const = v.left, v.right
            if isinstance(var, cst.Integer) and isinstance(v.operator, cst.Add):
                var, const = const, var
            if (
                isinstance(var, cst.Name)
                and var.value in scope.loop_vars
                and isinstance(const, cst.Integer)
            ):
                sign = -1 if isinstance(v.operator, cst.Subtract) else 1
                return Index(var.value, sign * int(const.value))
        if isinstance(v, cst.Name) and v.value in scope.gone:
            raise MacroError(scope.gone[v.value], v)
        if isinstance(v, cst.Subscript) and not nested:  # an indirect read: table[idx[i], j]
            return Index(None, 0, self._load(v, scope, as_index=True))
        if contains(v, cst.Subscript):
            raise MacroError(
                "data-dependent indexing is supported one level deep, as a plain load:"
                f" table[idx[i], j]; {usage}",
                v,
            )
        raise MacroError(usage, v)

    def _binary(self, op: str, left: Expr, right: Expr) -> Expr:
        return Binary(left.dims | right.dims, left.tensor or right.tensor, op, left, right)


def negate(e: Expr) -> Expr:
    if isinstance(e, Const):
        return Const(e.dims, False, -e.value)
    return Unary(e.dims, e.tensor, "-", e)


def contains(node: cst.CSTNode, kind: type) -> bool:
    """Whether ``node`` or anything under it is a ``kind``."""
    return next(find(node, kind), None) is not None
