"""The macros, one module per macro, and the registry that finds them.

Every module (or package) of this package that assigns ``FORMS`` at top level
is a macro, named by its ``NAME`` (else its module name), with ``USAGE`` and
``expand``: adding a macro is adding a module here plus its templates
(docs/macros.md). A module is imported when a file first uses its macro. The
protocol a macro implements is ``macrogen.expand.protocol``. Tests register
macros of their own with ``register``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from macrogen.markers import MACRO_NAMES

if TYPE_CHECKING:
    from macrogen.expand.protocol import ArgumentHook, ConstantHook, Constraint, Macro

_registered: dict[str, Macro] = {}
_names: tuple[str, ...] | None = None  # cached: names() is asked for every macrogen attribute


@functools.cache
def _discovered() -> dict[str, str]:
    """Macro name -> module, for the modules (or packages) here that assign ``FORMS``.

    Found from the source text, without importing: a file that uses one macro
    imports only that macro's module (some import heavy things, like libcst.matchers).
    """
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(__path__):
        folder = Path(__path__[0]) / info.name
        path = folder / "__init__.py" if info.ispkg else folder.with_suffix(".py")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if not _FORMS.search(text):
            continue
        name = _NAME.search(text)
        found[name.group(1) if name else info.name] = f"{__name__}.{info.name}"
    return found


# ``FORMS = ...`` at top level, or imported into the module (a package's __init__.py)
_FORMS = re.compile(r"^FORMS\b|^from \S+ import [^\n]*\bFORMS\b|^\s+FORMS,?\s*$", re.M)
_NAME = re.compile(r"^NAME\s*=\s*[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']", re.M)


def is_macro(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("FORMS", "USAGE", "expand"))


def _name(obj: object) -> str:
    name = getattr(obj, "NAME", None) or getattr(obj, "__name__", "").rsplit(".", 1)[-1]
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"{obj!r} has no usable NAME")
    return name


def names() -> tuple[str, ...]:
    """Every name a file may use as a macro (a marker without a module is reported at use)."""
    global _names
    if _names is None:
        _names = tuple(sorted({*_discovered(), *_registered, *MACRO_NAMES}))
    return _names


def get(name: str) -> Macro:
    """The macro called ``name``; KeyError when this installation has none."""
    if name in _registered:
        return _registered[name]
    module = importlib.import_module(_discovered()[name])
    if not is_macro(module):
        raise TypeError(f"{module.__name__} assigns FORMS but has no USAGE or expand")
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


# -- the optional hooks, looked up at each use (so a test may patch a module) -------------
def _hook(macro: Macro, hook: str) -> Callable[..., Any] | None:
    found = getattr(macro, hook, None)
    return found if callable(found) else None


def constant_hook(macro: Macro) -> ConstantHook | None:
    return cast("ConstantHook | None", _hook(macro, "constant"))


def argument_hook(macro: Macro) -> ArgumentHook | None:
    return cast("ArgumentHook | None", _hook(macro, "argument"))


def tuning_constraint(macro: Macro) -> Constraint | None:
    return cast("Constraint | None", _hook(macro, "tuning_constraint"))
