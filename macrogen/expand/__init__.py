"""The pass: source text -> libcst tree -> macro sites -> templates -> output text.

``expand_source`` is pure (no I/O) and shared by the CLI, the import hook,
autotune and the tests. Cost matters (it runs on every cold import): a file
that can't reach macrogen (``may_use_macros``) is returned as it is, and this
module imports neither libcst nor jinja2 to say so; the pass itself
(``expansion.py``) is imported for the first file that mentions macrogen.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from macrogen.expand.errors import ExpansionError, InternalError
from macrogen.expand.result import Expansion

if TYPE_CHECKING:
    from macrogen.expand.context import Options

__all__ = [
    "Expansion",
    "ExpansionError",
    "InternalError",
    "Options",
    "expand_source",
    "may_use_macros",
]

PACKAGE = "macrogen"


def may_use_macros(source: str) -> bool:
    """False when no macro can be reached from ``source``: the pass has nothing to do.

    A macro is reached only through an import that names the package (``import
    macrogen as mg``, ``from macrogen import tile``, ``from macrogen.markers import
    *``), so the identifier ``macrogen`` must be in the text. Python reads
    identifiers NFKC-normalized, so ``ｍａｃｒｏｇｅｎ`` (fullwidth) is that identifier
    too; every such spelling holds a non-ASCII character, and an identifier
    normalizes to the same characters inside the whole normalized text (what
    follows an identifier can't combine with it: combining characters are
    identifier characters themselves). Over-approximate by design: ``macrogen``
    in a comment or a string also says True, and the pass then finds no site.
    """
    if PACKAGE in source:
        return True
    if source.isascii() or unicodedata.is_normalized("NFKC", source):
        return False
    return PACKAGE in unicodedata.normalize("NFKC", source)


def expand_source(
    source: str,
    *,
    path: str = "<string>",
    target: str | None = None,
    tuning: Mapping[str, Any] | None = None,
) -> Expansion:
    """Expand every macro site of one file. Raises ExpansionError with all its errors."""
    if target not in (None, "cpu", "cuda"):
        raise ValueError(f"target must be 'cpu', 'cuda' or None, not {target!r}")
    if not may_use_macros(source):  # the cheap pre-check: no macrogen, nothing to do
        return Expansion(source, False)
    if source.startswith("\ufeff"):  # a byte order mark decoded as text: keep it, expand the rest
        result = expand_source(source[1:], path=path, target=target, tuning=tuning)
        return replace(result, code="\ufeff" + result.code)
    from macrogen.expand.context import Options
    from macrogen.expand.expansion import expand_file

    return expand_file(source, Options(path=path, target=target, tuning=dict(tuning or {})))


def __getattr__(name: str) -> Any:
    if name == "Options":  # lazy: it lives with the pass, which imports libcst
        from macrogen.expand.context import Options

        return Options
    raise AttributeError(f"module 'macrogen.expand' has no attribute {name!r}")
