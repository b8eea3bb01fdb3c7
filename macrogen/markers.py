"""The markers users write in their code.

Every marker is a no-op at run time, so an annotated file still runs serially and
gives the reference answer: decorators return what they decorate, ``define(x)``
and ``tunable(x, ...)`` return ``x``, ``fused_allreduce()`` is an empty context
and ``target(kind)`` tells whether this process would take that branch.
``macrogen expand`` reads these names in the source; it never calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

TARGETS = ("cpu", "cuda")


def define(value: T) -> T:
    """An expansion-time constant: ``D_MODEL = define(256)``."""
    return value


def tunable(default: T, *, choices: Iterable[T] | None = None) -> T:
    """A parameter ``macrogen autotune`` may choose; ``default`` until it does."""
    return default


def target(kind: str) -> bool:
    """``if target("cuda"):`` -- the branch for one kind of device.

    Unexpanded (and expanded without ``--target``) it is a run-time check.
    """
    if kind not in TARGETS:
        raise ValueError(f"target() takes one of {TARGETS}, not {kind!r}")
    import torch

    return torch.cuda.is_available() == (kind == "cuda")


def _decorator_marker(name: str) -> Callable[..., Any]:
    def marker(*args: Any, **kwargs: Any) -> Any:
        # Bare use (@data_parallel) gets the decorated object; called use
        # (@data_parallel(...)) gets the options and returns the identity.
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
            return args[0]
        return lambda obj: obj

    marker.__name__ = marker.__qualname__ = name
    marker.__doc__ = f"``@{name}(...)``: a no-op at run time; ``macrogen expand`` expands it."
    return marker


data_parallel = _decorator_marker("data_parallel")
tensor_parallel = _decorator_marker("tensor_parallel")
tile = _decorator_marker("tile")


@contextlib.contextmanager
def fused_allreduce(**options: Any):
    """``with fused_allreduce(): dist.all_reduce(a); dist.all_reduce(b)`` -- one collective once expanded."""
    yield


def resumable(iterable: Iterable[T], **options: Any) -> Iterable[T]:
    """``for step in resumable(range(n), model=..., dir=..., every=50):`` -- the plain loop.

    Expanded, the loop saves and resumes checkpoints (``macrogen.runtime.checkpoint``).
    """
    return iterable


MACRO_NAMES = (
    "data_parallel",
    "define",
    "fused_allreduce",
    "resumable",
    "target",
    "tensor_parallel",
    "tile",
    "tunable",
)
