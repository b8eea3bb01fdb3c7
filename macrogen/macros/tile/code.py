"""Expression code for @tile's generated functions, parenthesized by precedence.

Every piece of generated expression text is a ``Code``: its text and the
precedence of its outermost operator, so that operands get parentheses only
where Python needs them (``a * (b + c)``, ``(-0.5) ** 2``) and evaluation
order stays the loop's (``a - (b - c)``). Text comes from validated identifiers
and ``repr`` of numbers only; ``parse`` makes it the ``Expression`` the templates
render (``codegen``'s ``code`` filter), which knows the names it reads. A tile
site makes dozens of these: parsing each (libcst's parse cost ten times ast's)
gave nothing the printer needs, and the template's output is checked as a whole.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from dataclasses import dataclass

from macrogen.macro import Expression, ident

ATOM, POWER, UNARY, MUL, ADD, AND, OR, COMPARE, CONDITIONAL = 100, 14, 13, 12, 11, 8, 6, 5, 1
_BINARY = {
    "**": POWER,
    "*": MUL,
    "/": MUL,
    "//": MUL,
    "%": MUL,
    "@": MUL,
    "+": ADD,
    "-": ADD,
    "&": AND,
    "|": OR,
}
_BINARY.update(dict.fromkeys(("<", "<=", ">", ">=", "==", "!="), COMPARE))


@dataclass(frozen=True)
class Code:
    text: str
    prec: int = ATOM

    def __str__(self) -> str:
        return self.text

    def at(self, prec: int) -> str:
        """The text as an operand where ``prec`` binds: parenthesized if it binds looser."""
        return f"({self.text})" if self.prec < prec else self.text


Arg = Code | str


def _text(a: Arg) -> str:
    return a.text if isinstance(a, Code) else a


def name(n: str) -> Code:
    return Code(ident(n))


def number(value: float | int) -> Code:
    if isinstance(value, float) and math.isinf(value):
        return Code('float("inf")' if value > 0 else 'float("-inf")')
    return Code(repr(value), UNARY if value < 0 else ATOM)


def binary(op: str, left: Code, right: Code) -> Code:
    prec = _BINARY[op]
    if op == "**":  # right-associative
        lhs, rhs = left.at(prec + 1), right.at(prec)
    elif prec == COMPARE:  # chains mean something else: a < b < c
        lhs, rhs = left.at(prec + 1), right.at(prec + 1)
    else:  # left-associative: keep the loop's order for a - (b - c)
        lhs, rhs = left.at(prec), right.at(prec + 1)
    return Code(f"{lhs} {op} {rhs}", prec)


def chain(op: str, operands: list[Code]) -> Code:
    """``a op b op c``, left to right."""
    out = operands[0]
    for o in operands[1:]:
        out = binary(op, out, o)
    return out


def plus(code: Code, offset: int) -> Code:
    """``code + offset`` (``code - |offset|``; ``code`` itself for 0)."""
    if offset == 0:
        return code
    return binary("+" if offset > 0 else "-", code, Code(str(abs(offset))))


def neg(operand: Code) -> Code:
    return Code(f"-{operand.at(UNARY)}", UNARY)


def conditional(test: Code, then: Code, otherwise: Code) -> Code:
    """``then if test else otherwise``."""
    text = (
        f"{then.at(CONDITIONAL + 1)} if {test.at(CONDITIONAL + 1)} else {otherwise.at(CONDITIONAL)}"
    )
    return Code(text, CONDITIONAL)


def call(fn: str, *args: Arg, **kwargs: Arg) -> Code:
    parts = [_text(a) for a in args] + [f"{k}={_text(v)}" for k, v in kwargs.items()]
    return Code(f"{fn}({', '.join(parts)})")


def method(obj: Code, fn: str, *args: Arg, **kwargs: Arg) -> Code:
    return call(f"{obj.at(ATOM)}.{fn}", *args, **kwargs)


def suffix(obj: Code, text: str) -> Code:
    """``obj`` followed by an indexing suffix such as ``[:, None]`` (``obj`` for "")."""
    return Code(obj.at(ATOM) + text) if text else obj


def parse(code: Arg) -> Parsed:
    """Generated expression text, ready for a template's ``code`` filter."""
    return Parsed(_text(code))


class Parsed(Expression):
    """Generated expression text and, when asked, the names in it (``steps.drop_dead_stores``)."""

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Every name in the expression as libcst counts ``Name`` nodes: variables, attribute
        and keyword names, lambda parameters, and ``True``/``False``/``None`` (not keywords,
        nor words inside string literals or numbers: ``1e5``; tile writes no f-strings)."""
        return frozenset(
            word
            for word in _WORD.findall(self.text)
            if word and not (keyword.iskeyword(word) and word not in _NAMED_CONSTANTS)
        )


_NAMED_CONSTANTS = ("True", "False", "None")
# a string literal (skipped: the group is empty) or a word that does not start inside a number
_WORD = re.compile(r"""[rRbBuUfF]{0,2}(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')|\b([^\W\d]\w*)""")
