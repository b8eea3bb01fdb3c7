"""``torch.compiler.disable`` with its type: torch leaves it unannotated, which would make every
function it decorates untyped to mypy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager(fn: _Fn) -> _Fn:
    """``fn``, run eagerly under torch.compile (dynamo neither traces it nor what it calls)."""
    return cast(_Fn, torch.compiler.disable(fn))
