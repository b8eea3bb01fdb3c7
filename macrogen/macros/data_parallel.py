"""``@data_parallel(...)`` on an ``nn.Module`` class: gradients averaged over the data-parallel ranks.

    @mg.data_parallel(bucket_mb=25, compress="bf16")     # macrogen: data_parallel at train.py:12
    class GPT(nn.Module):                           ->   @data_parallel_class(DataParallelConfig(
        def __init__(self, config): ...                      bucket_mb=25, compress='bf16', ...,
        def forward(self, idx, targets): ...             ), where='train.py:12')
                                                     class GPT(nn.Module):
                                                         ... (the user's class, unchanged)

The class keeps its name and identity (registries and factories that captured
it build the data-parallel model) and the serial model's parameter names and
state_dict keys. ``macrogen.runtime.parallelize.data_parallel_class`` runs the
class's ``__init__`` inside the construction record (tensor-parallel layers
built in it are cut when it ends), then gives the model its
``macrogen.runtime.data_parallel.GradientSync``, which does the work (buckets,
overlap, accumulation, compression, start-up checks).

Arguments (keyword only; each may be a ``tunable``):
``bucket_mb`` (25), ``first_bucket_mb`` (1), ``compress`` (None, "bf16" or
"fp16"), ``accumulate`` (1), ``broadcast_buffers`` (True), ``sync_every`` (1: average
gradients every step; k > 1: local SGD, average parameters every k optimizer
steps), ``sync_warmup`` (0: synchronous steps before local SGD starts), ``overlap``
(False: the synchronization's all-reduce runs during the next ``delay`` steps),
``delay`` (1, with ``overlap``: 0 <= delay <= sync_every).

``outer=outer_sgd(lr=0.7, momentum=0.9, nesterov=True)`` (None: average the
parameters) is local SGD's outer optimizer (DiLoCo, docs/async.md), evaluated at
expansion (macros/outer_sgd.py): its ``lr`` and ``momentum`` may be ``tunable`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen import codegen
from macrogen.expand.args import Arg
from macrogen.expand.context import Context
from macrogen.expand.errors import MacroError
from macrogen.expand.protocol import Expanded, Form, Site, TuningEnv
from macrogen.macros.class_decorator import decorated
from macrogen.macros.outer_sgd import Outer

NAME = "data_parallel"
FORMS: frozenset[Form] = frozenset({"decorator"})
USAGE = (
    "@data_parallel(bucket_mb=25, first_bucket_mb=1, compress=None, accumulate=1,"
    " broadcast_buffers=True, sync_every=1, sync_warmup=0, outer=None, overlap=False, delay=1)"
    " decorates an nn.Module class"
)

# For an instance (``data_parallel()(resnet18())``): what applies data parallelism to a built model.
BUILT = 'parallelize(model, dp="replicate")'

DEFAULTS: dict[str, Any] = {
    "bucket_mb": 25,
    "first_bucket_mb": 1,
    "compress": None,
    "accumulate": 1,
    "broadcast_buffers": True,
    "sync_every": 1,
    "sync_warmup": 0,
    "outer": None,
    "overlap": False,
    "delay": 1,
}


@dataclass(frozen=True)
class Spec:
    name: str  # the user's class name
    bucket_mb: int | float  # MiB per bucket after the first
    first_bucket_mb: int | float  # MiB in the first bucket (starts communication early)
    compress: str | None  # None, "bf16" or "fp16"
    accumulate: int  # all-reduce every k-th backward
    broadcast_buffers: bool  # rank 0's buffers to every rank before each forward
    sync_every: int  # >1: local SGD, parameters averaged every k optimizer steps
    sync_warmup: int  # fully synchronous optimizer steps before local SGD starts
    outer: Outer | None  # local SGD's outer optimizer (DiLoCo); None: average the parameters
    overlap: bool  # the synchronization's all-reduce runs during the next `delay` steps
    delay: int  # with overlap: steps from the all-reduce's start to its use


def _positive_number(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        return "a positive number of MiB"
    return None


def _compress(v: Any) -> str | None:
    return None if v in (None, "bf16", "fp16") else 'None, "bf16" or "fp16"'


def _accumulate(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return "a whole number of backward passes >= 1"
    return None


def _steps(least: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            return f"a whole number of optimizer steps >= {least}"
        return None

    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


def _outer(v: Any) -> str | None:
    if v is None or isinstance(v, Outer):
        return None
    return "None or outer_sgd(lr=0.7, momentum=0.9, nesterov=True)"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "bucket_mb": _positive_number,
    "first_bucket_mb": _positive_number,
    "compress": _compress,
    "accumulate": _accumulate,
    "broadcast_buffers": _bool,
    "sync_every": _steps(1),
    "sync_warmup": _steps(0),
    "overlap": _bool,
    "delay": _steps(0),
    "outer": _outer,
}


def validate(site: Site, ctx: Context) -> Spec:
    node = site.original  # positions are known for the source's nodes
    if not isinstance(node, cst.ClassDef):
        raise MacroError(f"data_parallel() decorates a class: {USAGE}", site.call or site.original)
    if not node.bases:
        raise MacroError(
            f"data_parallel() decorates an nn.Module subclass; {node.name.value} has no base class",
            node.name,
        )
    args = site.args.bind(DEFAULTS)
    values = {name: args[name].value if name in args else d for name, d in DEFAULTS.items()}
    for name, arg in args.items():
        _check(name, arg, ctx)
    if "delay" in args and not values["overlap"]:
        raise MacroError("delay= needs overlap=True: it is how late an overlapped round is applied", args["delay"].node)
    if values["overlap"] and values["delay"] > values["sync_every"]:
        at = args.get("delay") or args["overlap"]
        raise MacroError(
            f"delay must be at most sync_every ({values['sync_every']}): one round in flight at a"
            f" time, not {values['delay']}",
            at.node,
        )
    return Spec(name=node.name.value, **values)


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """An overlapped round must be applied before the next one starts."""
    every, delay = arguments.get("sync_every", 1), arguments.get("delay", 1)
    if arguments.get("overlap") and isinstance(every, int) and isinstance(delay, int) and delay > every:
        return f"delay={delay} > sync_every={every}"
    return None


def _check(name: str, arg: Arg, ctx: Context) -> None:
    ctx.check_each_choice(name, arg, CHECKS[name])


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    assert isinstance(site.node, cst.ClassDef)
    decorator = ctx.import_from("macrogen.runtime.parallelize", "data_parallel_class")
    config = ctx.import_from("macrogen.runtime.data_parallel", "DataParallelConfig")
    imports = [decorator, config]
    outer_sgd = None
    if spec.outer is not None:
        outer_sgd = ctx.import_from("macrogen.runtime.local_sgd", "OuterSGD")
        imports.append(outer_sgd)
    _, rendered = codegen.render_statements(
        "data_parallel.py.j2",
        name=spec.name,
        location=ctx.location(site.line),
        decorator=decorator,
        config=config,
        bucket_mb=spec.bucket_mb,
        first_bucket_mb=spec.first_bucket_mb,
        compress=spec.compress,
        accumulate=spec.accumulate,
        broadcast_buffers=spec.broadcast_buffers,
        sync_every=spec.sync_every,
        sync_warmup=spec.sync_warmup,
        outer=spec.outer,
        outer_sgd=outer_sgd,
        overlap=spec.overlap,
        delay=spec.delay,
    )
    assert isinstance(rendered, cst.ClassDef)
    plan = rendered.decorators[0].with_changes(leading_lines=rendered.leading_lines)
    # the class object itself keeps its name and identity
    return Expanded([decorated(ctx, site.node, plan)], imports=tuple(imports))
