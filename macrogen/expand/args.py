"""Macro arguments, evaluated at expansion time.

An argument is a literal (numbers, strings, True/False/None, and lists, tuples,
dicts and sets of them), simple arithmetic on numbers, a ``define``d or
``tunable`` module constant, or ``tunable(default, choices=[...])`` itself.
Anything else would need the program to run, so it is an error at its position.
"""

from __future__ import annotations

import cmath
import operator
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen.expand.errors import MacroError
from macrogen.expand.literals import evaluated
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

    value: Any  # for a code argument: the expression node itself
    node: cst.BaseExpression
    tunable: str | None = None  # the tuning key, when the value came from tunable()
    code: bool = False  # ordinary code the program runs (a macro's CODE_ARGUMENTS), not a value


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


# Which macro of the "argument" form a call is, if any (and marks it used):
# (macro name, its USAGE, its ``argument`` hook).
ArgumentMacro = Callable[[cst.Call], "tuple[str, str, ArgumentHook] | None"]
# The hook: (the call, its tuning key, this evaluator) -> (value, tuning key or None).
ArgumentHook = Callable[[cst.Call, str, "Evaluator"], "tuple[Any, str | None]"]
# Records a tunable and returns its value: (key, default, choices, node).
UseTunable = Callable[[str, Any, tuple[Any, ...], cst.CSTNode], Any]


def no_argument_macros(call: cst.Call) -> None:
    return None


class Evaluator:
    def __init__(
        self,
        constants: Mapping[str, Any],
        argument_macro: ArgumentMacro,
        use_tunable: UseTunable,
    ):
        self.constants = constants
        self.argument_macro = argument_macro
        self.use_tunable = use_tunable

    def plain(self) -> Evaluator:
        """An evaluator for the arguments of an argument-form macro: no macros inside."""
        return Evaluator(self.constants, no_argument_macros, self.use_tunable)

    def call_args(self, call: cst.Call | None, key_prefix: str, code: Collection[str] = ()) -> Args:
        """Evaluate a macro call's arguments; those named in ``code`` (a keyword, or a
        position "0", "1"...) stay expressions, for the program to run."""
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
            if (name if name is not None else str(i)) in code:
                evaluated = Arg(arg.value, arg.value, None, code=True)
            else:
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
        """A whole argument: the only place an argument-form macro (``tunable(...)``) may stand."""
        if isinstance(node, cst.Call):
            found = self.argument_macro(node)
            if found is not None:
                return found[2](node, key, self)
        return self.value(node), None

    def value(self, node: cst.BaseExpression) -> Any:
        if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary)):
            try:
                return _small(evaluated(node), node)
            except ValueError:  # more digits than int() converts
                raise MacroError(_TOO_LARGE, node) from None
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            value = evaluated(node)
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
            for entry in node.elements:
                if not isinstance(entry, cst.DictElement):
                    raise MacroError("unpacking with ** is not allowed in a macro argument", entry)
                k = self.value(entry.key)
                try:
                    out[k] = self.value(entry.value)
                except TypeError:
                    raise MacroError("dict keys must be hashable", entry.key) from None
            return out
        if isinstance(node, cst.Call):
            found = self.argument_macro(node)
            if found is not None:
                raise MacroError(f"{found[0]}() can't be used here: {found[1]}", node)
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
