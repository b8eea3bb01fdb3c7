"""The macros, one module per macro, and the registry that names them.

``MODULES`` is the one list of the macros that ship with macrogen: name -> module.
The markers (``macrogen.markers.MACRO_NAMES``) and the pass both read it; adding a
macro is a module here, its templates, its marker and a line below (docs/macros.md).
A module is imported when a file first uses its macro. What a macro implements is
``macrogen.expand.protocol``; what it may import from the pass, ``macrogen.macro``.
Tests register macros of their own with ``register``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from macrogen.macro import Macro

MODULES: dict[str, str] = {
    "data_parallel": "macrogen.macros.data_parallel",
    "define": "macrogen.macros.define",
    "fused_allreduce": "macrogen.macros.fused_allreduce",
    "outer_sgd": "macrogen.macros.outer_sgd",
    "parallelize": "macrogen.macros.parallelize",
    "pipeline": "macrogen.macros.pipeline",
    "resumable": "macrogen.macros.resumable",
    "shard_optimizer": "macrogen.macros.shard_optimizer",
    "target": "macrogen.macros.target",
    "tensor_parallel": "macrogen.macros.tensor_parallel",
    "tile": "macrogen.macros.tile",
    "tunable": "macrogen.macros.tunable",
}

_registered: dict[str, Macro] = {}
_names: tuple[str, ...] | None = None  # cached: names() is asked for every macrogen attribute


def is_macro(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("FORMS", "USAGE", "expand"))


def _name(obj: object) -> str:
    name = getattr(obj, "NAME", None) or getattr(obj, "__name__", "").rsplit(".", 1)[-1]
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"{obj!r} has no usable NAME")
    return name


def names() -> tuple[str, ...]:
    """Every name a file may use as a macro."""
    global _names
    if _names is None:
        _names = tuple(sorted({*MODULES, *_registered}))
    return _names


def get(name: str) -> Macro:
    """The macro called ``name``; KeyError when this installation has none."""
    if name in _registered:
        return _registered[name]
    module = importlib.import_module(MODULES[name])
    if not is_macro(module):
        raise TypeError(f"{module.__name__} is registered but has no FORMS, USAGE or expand")
    return cast("Macro", module)


def register(macro: object) -> None:
    """Add a macro that does not live in this package (tests); replaces one of the same name."""
    if not is_macro(macro):
        raise TypeError(f"{macro!r} is not a macro: it needs FORMS, USAGE and expand")
    global _names
    _registered[_name(macro)] = cast("Macro", macro)
    _names = None


def unregister(name: str) -> None:
    global _names
    _registered.pop(name, None)
    _names = None
