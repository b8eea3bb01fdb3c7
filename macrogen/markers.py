"""The markers users write in their code.

Every marker is a no-op at run time, so an annotated file still runs serially and
gives the reference answer: decorators return what they decorate, ``define(x)``
and ``tunable(x, ...)`` return ``x``, ``fused_allreduce()`` is an empty context
and ``target(kind)`` tells whether this process would take that branch.
``macrogen expand`` reads these names in the source; it never calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from macrogen.macros import MODULES

# Attributes of ``macrogen`` a file may use that are not macros.
NON_MACRO_NAMES = frozenset(
    {
        "__version__",
        "autotune",
        "clip_grad_norm_",
        "expand",
        "expand_source",
        "ExpansionError",
        "hook",
        "kernels",
        "launch",
        "load",
        "markers",
        "mesh",
        "pipeline_step",
        "runtime",
        "shard",
    }
)

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
pipeline = _decorator_marker("pipeline")


def pipeline_step(model: Any, x: Any, y: Any, loss_fn: Callable[..., Any] | None = None) -> Any:
    """``loss = pipeline_step(model, x, y, loss_fn)``: one training step's forward and backward.

    Serially ``loss = loss_fn(model(x), y); loss.backward(); return loss`` (a tuple
    from forward gives loss_fn its first element). Without ``loss_fn`` the model
    computes its loss, nanoGPT's way: ``model(x, y)`` returns it or ``(output, loss)``. A model
    made ``@pipeline`` runs its schedule instead (a schedule interleaves the
    micro-batches' backwards with forwards, so it must own the backward) and
    returns the batch's mean loss, detached, on every rank. Not a macro: the
    same function runs in the unexpanded and the expanded program.
    """
    from macrogen.runtime.pipeline import pipeline_step as step  # torch only when used

    return step(model, x, y, loss_fn)


def shard(model: Any, batch: T) -> T:
    """``x, y = shard(model, (x, y))``: this rank's rows of the global batch.

    Serially (and for a model without ``dp_shares``, on one rank) the batch as it is.
    Under ``dp_shares`` every rank loads the same global batch and gets its own
    slice of its rows, uneven by the ranks' speed; the gradients are weighted by
    rows, so the step equals the serial step on the whole batch
    (``macrogen.runtime.shares``). Not a macro: the same function runs in the
    unexpanded and the expanded program.
    """
    from macrogen.runtime.data_parallel import shard as cut  # torch only when used

    part: T = cut(model, batch)
    return part


@contextlib.contextmanager
def fused_allreduce(**options: Any) -> Iterator[None]:
    """``with fused_allreduce(): dist.all_reduce(a); dist.all_reduce(b)`` -- one collective once expanded."""
    yield


def resumable(iterable: Iterable[T], **options: Any) -> Iterable[T]:
    """``for step in resumable(range(n), model=..., dir=..., every=50):`` -- the plain loop.

    Expanded, the loop saves and resumes checkpoints (``macrogen.runtime.checkpoint``).
    """
    return iterable


def shard_optimizer(optimizer: T) -> T:
    """``opt = shard_optimizer(torch.optim.AdamW(...))``: the optimizer itself until expanded
    (then its state is sharded over the data-parallel ranks, ZeRO-1)."""
    return optimizer


def parallelize(model: T, **options: Any) -> T:
    """``model = parallelize(model, tp=2, tp_plan=..., dp="replicate")``: the model itself until
    expanded (then it is sharded and its gradients averaged, in place: docs/parallelize.md).
    With ``init=`` (a model built on the meta device) it gives the model its serial values."""
    if options.get("init") is not None:
        from macrogen.runtime.materialize import serial

        return serial(model, options["init"])  # type: ignore[arg-type, return-value]
    return model


def outer_sgd(*, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> dict[str, Any]:
    """``@data_parallel(sync_every=k, outer=outer_sgd(lr=0.7, momentum=0.9, nesterov=True))``:
    the outer optimizer of local SGD (DiLoCo; docs/async.md), an expansion-time argument of
    ``data_parallel``; at run time, unexpanded, only a description the no-op decorator ignores."""
    return {"lr": lr, "momentum": momentum, "nesterov": nesterov}


# The macros' names, from the registry the pass reads too (one list: macrogen.macros.MODULES)
MACRO_NAMES = tuple(MODULES)
