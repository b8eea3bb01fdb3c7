"""A literal node's value, as libcst's ``evaluated_value`` gives it, mostly without ``ast``.

``evaluated_value`` calls ``ast.literal_eval``, which parses the text and makes
a recursive closure per call (a reference cycle, left to the cycle collector):
for a number, ``int``/``float`` of its text give the same value (both read
underscores, prefixes and exponents as Python does), and a string without a
backslash or carriage return holds its text as written. Anything else goes
to ``evaluated_value``.
"""

from __future__ import annotations

from typing import Any

import libcst as cst


def evaluated(node: cst.BaseExpression) -> Any:
    """``node.evaluated_value`` (an Integer, Float, Imaginary, or a string literal)."""
    kind = type(node)
    if kind is cst.Integer:
        try:
            return int(node.value, 0)  # type: ignore[attr-defined]
        except ValueError:
            pass  # (more digits than int() converts: evaluated_value raises the same)
    elif kind is cst.Float:
        try:
            return float(node.value)  # type: ignore[attr-defined]
        except ValueError:  # pragma: no cover - a Float libcst parsed is a Python float
            pass
    elif kind is cst.SimpleString:
        text: str = node.value  # type: ignore[attr-defined]
        if "\\" not in text and "\r" not in text:
            start = len(text) - len(text.lstrip("bBfFrRuU"))  # where the quotes start
            if text[:start] in ("", "r", "R", "u", "U"):  # (b, f: not the text as a str)
                quote = 3 if text.startswith(('"""', "'''"), start) else 1
                return text[start + quote : len(text) - quote]
    return node.evaluated_value  # type: ignore[attr-defined]
