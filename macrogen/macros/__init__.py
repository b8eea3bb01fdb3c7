"""One module per macro. Each exposes:

- ``FORMS``: the syntactic places it may stand ("decorator", "with", "if",
  "elif", "assign", "argument");
- ``USAGE``: one line showing the supported syntax, used in error messages;
- ``expand(site, ctx)``: validates ``site.args`` into a frozen spec and returns
  the statements that replace the site (rendered from its templates).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from macrogen.markers import MACRO_NAMES


def get(name: str) -> ModuleType:
    if name not in MACRO_NAMES:
        raise KeyError(name)
    return importlib.import_module(f"macrogen.macros.{name}")
