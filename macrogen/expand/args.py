"""Macro arguments, evaluated at expansion time.

An argument is a literal (numbers, strings, True/False/None, and lists, tuples,
dicts and sets of them), simple arithmetic on numbers, a ``define``d or
``tunable`` module constant, or ``tunable(default, choices=[...])`` itself.
Anything else would need the program to run, so it is an error at its position.
"""

from __future__ import annotations

import cmath
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen.expand.errors import MacroError
from macrogen.expand.sites import did_you_mean

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    cst.Add: operator.add,
    cst.Subtract: operator.sub,
    cst.Multiply: operator.mul,
    cst.FloorDivide: operator.floordiv,
    cst.Divide: operator.truediv,
    cst.Modulo: operator.mod,
    cst.Power: operator.pow,
}


@dataclass(frozen=True)
class Arg:
    """One evaluated argument and where it is in the source."""

    value: Any
    node: cst.BaseExpression
    tunable: str | None = None  # the tuning key, when the value came from tunable()


@dataclass(frozen=True)
class Args:
    positional: tuple[Arg, ...]
    keywords: Mapping[str, Arg]
    call: cst.Call | None

    def bind(
        self, defaults: Mapping[str, Any], *, positional: tuple[str, ...] = ()
    ) -> dict[str, Arg]:
        """Match arguments to parameter names; unknown, repeated or extra ones are errors."""
        out: dict[str, Arg] = {}
        if len(self.positional) > len(positional):
            extra = self.positional[len(positional)]
            takes = (
                f"takes {len(positional)} positional argument(s)"
                if positional
                else "takes keyword arguments only"
            )
            raise MacroError(f"this macro {takes} ({', '.join(defaults) or 'none'})", extra.node)
        for name, arg in zip(positional, self.positional):
            out[name] = arg
        for name, arg in self.keywords.items():
            if name not in defaults:
                raise MacroError(
                    f"unknown argument {name!r}{did_you_mean(name, list(defaults))}"
                    f" (arguments: {', '.join(defaults) or 'none'})",
                    arg.node,
                )
            if name in out:
                raise MacroError(f"argument {name!r} given twice", arg.node)
            out[name] = arg
        return out


# A callback that says whether a call is ``tunable(...)`` (and marks it used).
IsTunable = Callable[[cst.Call], bool]
# A callback that records a tunable and returns its value: (key, default, choices, node).
UseTunable = Callable[[str, Any, tuple[Any, ...], cst.CSTNode], Any]


class Evaluator:
    def __init__(
        self, constants: Mapping[str, Any], is_tunable: IsTunable, use_tunable: UseTunable
    ):
        self.constants = constants
        self.is_tunable = is_tunable
        self.use_tunable = use_tunable

    def call_args(self, call: cst.Call | None, key_prefix: str) -> Args:
        if call is None:
            return Args((), {}, None)
        positional: list[Arg] = []
        keywords: dict[str, Arg] = {}
        for i, arg in enumerate(call.args):
            if arg.star:
                raise MacroError("macro arguments can't be unpacked with * or **", arg)
            name = arg.keyword.value if arg.keyword is not None else None
            if name is not None and name in keywords:
                raise MacroError(f"argument {name!r} given twice", arg.keyword)
            key = f"{key_prefix}.{name if name is not None else i}"
            value, tunable = self.argument(arg.value, key)
            evaluated = Arg(value, arg.value, tunable)
            if name is None:
                if keywords:
                    raise MacroError("positional argument follows keyword argument", arg)
                positional.append(evaluated)
            else:
                keywords[name] = evaluated
        return Args(tuple(positional), keywords, call)

    def argument(self, node: cst.BaseExpression, key: str) -> tuple[Any, str | None]:
        """A whole argument: the only place an inline ``tunable(...)`` may stand."""
        if isinstance(node, cst.Call) and self.is_tunable(node):
            return self.tunable(node, key), key
        return self.value(node), None

    def tunable(self, call: cst.Call, key: str) -> Any:
        default, choices = self.tunable_spec(call)
        return self.use_tunable(key, default, choices, call)

    def tunable_spec(self, call: cst.Call) -> tuple[Any, tuple[Any, ...]]:
        args = Evaluator(self.constants, lambda c: False, self.use_tunable).call_args(call, "")
        bound = args.bind({"default": None, "choices": None}, positional=("default", "choices"))
        if "default" not in bound:
            raise MacroError("tunable() needs a default: tunable(64, choices=[32, 64, 128])", call)
        default = bound["default"].value
        if "choices" not in bound:
            raise MacroError(
                "tunable() needs choices=[...] to search: tunable(64, choices=[32, 64, 128])", call
            )
        choices = bound["choices"].value
        if not isinstance(choices, (list, tuple)) or not choices:
            raise MacroError("choices must be a non-empty list of literals", bound["choices"].node)
        if len(set(map(repr, choices))) != len(choices):
            raise MacroError("choices must not repeat a value", bound["choices"].node)
        if default not in choices:
            raise MacroError(
                f"the default {default!r} is not one of the choices {list(choices)}",
                bound["default"].node,
            )
        return default, tuple(choices)

    def value(self, node: cst.BaseExpression) -> Any:
        if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary)):
            try:
                return _small(node.evaluated_value, node)
            except ValueError:  # more digits than int() converts
                raise MacroError(_TOO_LARGE, node) from None
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            value = node.evaluated_value
            if isinstance(value, str) or isinstance(value, bytes):
                return value
            raise MacroError("f-strings are not known at expansion time", node)
        if isinstance(node, cst.Name):
            if node.value in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.value]
            if node.value in self.constants:
                return self.constants[node.value]
            raise MacroError(
                f"{node.value!r} is not known at expansion time: a macro argument must be a literal,"
                " a define()d constant or a tunable()",
                node,
            )
        if isinstance(node, cst.UnaryOperation):
            operand = self.value(node.expression)
            if isinstance(node.operator, cst.Minus) and _is_number(operand):
                return -operand
            if isinstance(node.operator, cst.Plus) and _is_number(operand):
                return +operand
            if isinstance(node.operator, cst.Not):
                return not operand
        if isinstance(node, cst.BinaryOperation) and type(node.operator) in _BINOPS:
            left, right = self.value(node.left), self.value(node.right)
            if _is_number(left) and _is_number(right):
                if isinstance(node.operator, cst.Power) and _huge_power(left, right):
                    raise MacroError(_TOO_LARGE, node)
                try:
                    return _small(_BINOPS[type(node.operator)](left, right), node)
                except (ArithmeticError, ValueError) as e:
                    raise MacroError(f"can't evaluate this at expansion time: {e}", node) from None
        if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
            items = []
            for el in node.elements:
                if isinstance(el, cst.StarredElement):
                    raise MacroError("unpacking with * is not allowed in a macro argument", el)
                items.append(self.value(el.value))
            if isinstance(node, cst.Set):
                try:
                    return frozenset(items)
                except TypeError:
                    raise MacroError("set items must be hashable", node) from None
            return items if isinstance(node, cst.List) else tuple(items)
        if isinstance(node, cst.Dict):
            out: dict[Any, Any] = {}
            for el in node.elements:
                if not isinstance(el, cst.DictElement):
                    raise MacroError("unpacking with ** is not allowed in a macro argument", el)
                k = self.value(el.key)
                try:
                    out[k] = self.value(el.value)
                except TypeError:
                    raise MacroError("dict keys must be hashable", el.key) from None
            return out
        if isinstance(node, cst.Call) and self.is_tunable(node):
            raise MacroError("tunable() must be a whole macro argument or a module constant", node)
        raise MacroError(
            "this is not known at expansion time: a macro argument must be a literal,"
            " a define()d constant or a tunable()",
            node,
        )


_TOO_LARGE = "this number is too large for a macro argument"
_MAX_BITS = 4096


def _small(value: Any, node: cst.CSTNode) -> Any:
    """Numbers stay small enough to compute with and write back (no 10**10**10, no inf or nan)."""
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise MacroError(_TOO_LARGE, node)
    if isinstance(value, (float, complex)) and not cmath.isfinite(value):
        raise MacroError(
            f"a macro argument must be a finite number, not {value!r} (the value overflows a float)",
            node,
        )
    return value


def _huge_power(base: Any, exponent: Any) -> bool:
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) < 2:
        return False
    return exponent > _MAX_BITS or exponent * (abs(base).bit_length() - 1) > _MAX_BITS


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, complex)) and not isinstance(v, bool)
