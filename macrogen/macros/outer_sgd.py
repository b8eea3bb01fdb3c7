"""``outer_sgd(lr=0.7, momentum=0.9, nesterov=True)``: local SGD's outer optimizer, as an argument.

    @mg.data_parallel(sync_every=8, outer=mg.outer_sgd(lr=mg.tunable(0.7, choices=[0.5, 0.7])))

A whole argument of ``data_parallel`` (the ``argument`` form, like ``tunable``):
``data_parallel`` receives an ``Outer`` and renders ``OuterSGD(...)`` into the
generated class (docs/async.md). Its arguments are literals, ``define``d
constants or ``tunable``s (key ``<site>.outer.lr``). Unexpanded, the marker
returns a description that the no-op decorator ignores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen.macro import Arg, Context, Evaluator, Expanded, Form, MacroError, Site

NAME = "outer_sgd"
FORMS: frozenset[Form] = frozenset({"argument"})
USAGE = (
    "outer_sgd() is data_parallel's outer= argument:"
    " @data_parallel(sync_every=8, outer=outer_sgd(lr=0.7, momentum=0.9, nesterov=True))"
)
DEFAULTS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@dataclass(frozen=True)
class Outer:
    """The outer optimizer's update rule: torch's SGD (dampening 0) on the averaged delta."""

    lr: float  # DiLoCo: 0.7
    momentum: float  # 0: none
    nesterov: bool  # needs momentum > 0


def _lr(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        return "a positive number"
    return None


def _momentum(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        return "a number in [0, 1)"
    return None


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "lr": _lr,
    "momentum": _momentum,
    "nesterov": _bool,
}


def argument(call: cst.Call, key: str, evaluator: Evaluator) -> tuple[object, str | None]:
    """The ``Outer`` the call describes; its own tunables carry their keys (``key.lr``)."""
    args = evaluator.call_args(call, key).bind(DEFAULTS)
    for name, arg in args.items():
        _check(name, arg)
    values = {name: args[name].value if name in args else d for name, d in DEFAULTS.items()}
    if values["nesterov"] and not values["momentum"]:
        raise MacroError("outer_sgd: nesterov=True needs momentum > 0 (as torch.optim.SGD)", call)
    return Outer(lr=values["lr"], momentum=values["momentum"], nesterov=values["nesterov"]), None


def _check(name: str, arg: Arg) -> None:
    wanted = CHECKS[name](arg.value)
    if wanted is not None:
        raise MacroError(f"outer_sgd: {name} must be {wanted}, not {arg.value!r}", arg.node)


def expand(site: Site, ctx: Context) -> Expanded:  # only the argument form exists
    raise MacroError(f"outer_sgd() can't be used here: {USAGE}", site.call or site.original)
