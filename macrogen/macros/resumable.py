"""``for x in resumable(iterable, model=..., optimizer=..., dir=..., every=...)``: a loop that survives restarts.

    for step in mg.resumable(range(steps), model=model,      # macrogen: resumable at train.py:40
                             optimizer=opt, dir="ckpt",  ->  for step in resumable(range(steps), model=model,
                             every=50):                          optimizer=opt, dir="ckpt", every=50, keep=2):
        train_step(step)                                          train_step(step)

with ``from macrogen.runtime.checkpoint import resumable`` in the helpers block.
Unexpanded, the marker returns the iterable (the plain loop, the serial reference);
expanded, ``macrogen.runtime.checkpoint.resumable`` loads the latest complete DCP
checkpoint under ``dir``, skips the steps it covers and saves every ``every`` steps
asynchronously, keeping the last ``keep`` (docs/elastic.md).

Arguments: the iterable, ``model``, ``optimizer`` (optional), ``dir`` and ``fresh``
(optional: start at step 0, ``args.fresh`` works) are the program's own expressions;
``every``, ``keep`` (default 2) and ``on_save_error`` (optional, ``"error"`` or
``"warn"``) are known at expansion time (literals, ``define``d constants, ``tunable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen.macro import Arg, Context, Expanded, Form, MacroError, Site, py

NAME = "resumable"
FORMS: frozenset[Form] = frozenset({"loop"})
USAGE = (
    'for step in resumable(range(steps), model=model, optimizer=opt, dir="ckpt", every=50,'
    " keep=2): ..."
)
CODE_ARGUMENTS = frozenset({"0", "iterable", "model", "optimizer", "dir", "fresh"})
PARAMETERS: dict[str, Any] = {
    "iterable": None,
    "model": None,
    "optimizer": None,
    "dir": None,
    "every": None,
    "keep": 2,
    "fresh": None,
    "on_save_error": None,
}
ON_SAVE_ERROR = ("error", "warn")
REQUIRED = ("iterable", "model", "dir", "every")


@dataclass(frozen=True)
class Spec:
    every: int  # steps between checkpoints
    keep: int  # complete checkpoints kept
    on_save_error: str | None  # "warn": a save the disk refuses is a warning (None: the default)


def validate(site: Site) -> Spec:
    args = site.args.bind(PARAMETERS, positional=("iterable",))
    at = site.call or site.original
    for name in REQUIRED:
        if name not in args:
            raise MacroError(f"resumable() needs {name}=...: {USAGE}", at)
    keep = _count("keep", args["keep"]) if "keep" in args else PARAMETERS["keep"]
    on_save_error = None
    if "on_save_error" in args:
        arg = args["on_save_error"]
        if arg.value not in ON_SAVE_ERROR:
            raise MacroError(
                f"on_save_error must be 'error' or 'warn', not {arg.value!r}", arg.node
            )
        on_save_error = arg.value
    return Spec(every=_count("every", args["every"]), keep=keep, on_save_error=on_save_error)


def _count(name: str, arg: Arg) -> int:
    if isinstance(arg.value, bool) or not isinstance(arg.value, int) or arg.value < 1:
        raise MacroError(f"{name} must be a whole number >= 1, not {arg.value!r}", arg.node)
    return arg.value


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site)
    loop = site.node
    assert isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call)
    runtime = ctx.import_from("macrogen.runtime", "resumable")
    # The call keeps the program's own expressions (as expanded: site.node) and gets
    # every and keep as literals, all as keywords after the iterable.
    code = {
        (a.keyword.value if a.keyword else "iterable"): a.value
        for a in loop.iter.args
        if (a.keyword.value if a.keyword else "iterable") in CODE_ARGUMENTS
    }
    code.update(every=_literal(spec.every), keep=_literal(spec.keep))
    if spec.on_save_error is not None:
        code["on_save_error"] = _literal(spec.on_save_error)
    args = [cst.Arg(code.pop("iterable"))]
    args += [
        cst.Arg(code[name], keyword=cst.Name(name), equal=_EQUAL)
        for name in PARAMETERS
        if name in code
    ]
    call = loop.iter.with_changes(func=cst.Name(runtime.local), args=_commas(args))
    return Expanded([loop.with_changes(iter=call)])


_EQUAL = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def _literal(value: int | str) -> cst.BaseExpression:
    return cst.parse_expression(py(value))


def _commas(args: list[cst.Arg]) -> list[cst.Arg]:
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return [a.with_changes(comma=comma) for a in args[:-1]] + args[-1:]
