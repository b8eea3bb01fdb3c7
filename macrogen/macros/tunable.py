"""``tunable(default, choices=[...])``: a parameter that ``macrogen autotune`` chooses.

As a module constant:

    BLOCK = mg.tunable(64, choices=[32, 64, 128])   ->   # tunable BLOCK = 128 (tuned); choices [32, 64, 128]
                                                          BLOCK = 128

As a whole macro argument, ``@mg.tile(i=mg.tunable(64, choices=[32, 64]))``, the
macro receives the value (the ``argument`` hook). The tuning key is the
constant's name, or the site's qualified name and the argument
(``bias_gelu.i``). Without a tuning entry the default is used.
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from macrogen.macro import Context, Evaluator, Expanded, Form, MacroError, Site
from macrogen.macros.define import check_module_constant, literal_assignment

NAME = "tunable"
FORMS: frozenset[Form] = frozenset({"assign", "argument"})
USAGE = (
    "tunable() is a whole macro argument, @tile(i=tunable(64, choices=[32, 64])),"
    " or a module constant, BLOCK = tunable(64, choices=[32, 64])"
)


def constant(name: str, call: cst.Call, evaluator: Evaluator) -> object:
    return argument(call, name, evaluator)[0]


def argument(call: cst.Call, key: str, evaluator: Evaluator) -> tuple[object, str | None]:
    default, choices = spec(call, evaluator.plain())
    return evaluator.use_tunable(key, default, choices, call), key


def spec(call: cst.Call, evaluator: Evaluator) -> tuple[Any, tuple[Any, ...]]:
    """The default and the choices, checked."""
    bound = evaluator.call_args(call, "").bind(
        {"default": None, "choices": None}, positional=("default", "choices")
    )
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


def expand(site: Site, ctx: Context) -> Expanded:
    name = check_module_constant(site)
    t = ctx.tunables[name]
    how = "tuned" if name in ctx.options.tuning else "the default"
    note = f"# tunable {t.key} = {t.value!r} ({how}); choices {list(t.choices)}"
    return Expanded([literal_assignment(site, ctx, [cst.EmptyLine(comment=cst.Comment(note))])])
