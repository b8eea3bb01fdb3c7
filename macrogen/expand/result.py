"""What the pass returns for one file (its own module: the pass imports it, and so does the light
``macrogen.expand`` that answers a file without macros without importing the pass)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from macrogen.expand.context import SiteArguments, Tunable


@dataclass(frozen=True)
class Expansion:
    code: str
    changed: bool  # False when the file has no macro sites (code is then the input)
    tunables: Mapping[str, Tunable] = field(default_factory=dict)  # every tunable, by key
    sites: tuple[tuple[str, int], ...] = ()  # (macro, line) of each expanded site
    arguments: tuple[SiteArguments, ...] = ()  # each expanded site's arguments (for autotune)
