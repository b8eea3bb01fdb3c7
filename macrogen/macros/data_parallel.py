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
``dp_shares`` (None; "even", "measured" or one share per rank: each step's global batch
cut unevenly by ``mg.shard(model, batch)``, gradients weighted by rows, as
``mg.parallelize``'s), ``dp_rebalance_every`` (10) and ``dp_max_rows`` (None).

``outer=outer_sgd(lr=0.7, momentum=0.9, nesterov=True)`` (None: average the
parameters) is local SGD's outer optimizer (DiLoCo, docs/async.md), evaluated at
expansion (macros/outer_sgd.py): its ``lr`` and ``momentum`` may be ``tunable`` too.

``shard="full"`` (None: every rank holds every parameter) is FSDP on torch's FSDP2, as
``mg.parallelize(model, dp="fsdp")`` applies it to a built model: the generated
``__init__`` ends with ``macrogen.runtime.fully_sharded.apply_fully_sharded`` instead of a
``GradientSync``. With it: ``accumulate``, and parallelize's FSDP arguments
``reshard_after_forward`` (True), ``mixed_precision`` (None, "bf16", "fp16"),
``cpu_offload`` (False), ``shard_units`` (None: the repeated layer list) and
``dp_replicate`` (1; R > 1: HSDP); the bucket, compression, buffer and local SGD
arguments are for replicated parameters only.
``servers=S`` with ``server_plan=["emb", ...]`` (paths of nn.Embedding / nn.EmbeddingBag
layers; ``{"emb": "server"}`` is accepted too): those tables live on the last S ranks, a
parameter server (``macrogen.runtime.param_server``, docs/async.md), with ``staleness`` (0),
``server_optimizer`` ("sgd" or "adagrad") and ``server_lr`` (0.01); the rest is averaged
over the workers. Not with local SGD or ``accumulate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import libcst as cst

from macrogen.macro import (
    Arg,
    Context,
    Expanded,
    Form,
    MacroError,
    Site,
    TuningEnv,
)
from macrogen.macros import parallelize_arguments, redundant, uneven
from macrogen.macros.class_decorator import decorated, rendered_decorator
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
    "shard": None,
    "reshard_after_forward": True,
    "mixed_precision": None,
    "cpu_offload": False,
    "shard_units": None,
    "dp_replicate": 1,
    "servers": 0,
    "server_plan": None,
    "staleness": 0,
    "server_optimizer": "sgd",
    "server_lr": 0.01,
    "dp_shares": None,
    "dp_rebalance_every": 10,
    "dp_max_rows": None,
}
SHARE_ARGS = ("dp_shares", "dp_rebalance_every", "dp_max_rows")  # as mg.parallelize's
SHARD_MODES = (None, "full")
FSDP_ONLY = parallelize_arguments.FSDP_ONLY  # reshard_after_forward, ..., dp_replicate
REPLICATED_ONLY = (
    "bucket_mb",
    "first_bucket_mb",
    "compress",
    "broadcast_buffers",
    "sync_every",
    "sync_warmup",
    "outer",
    "overlap",
    "delay",
    *SHARE_ARGS,
)
SERVER_ARGS = ("server_plan", "staleness", "server_optimizer", "server_lr")


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
    shard: str | None  # "full": FSDP (parameters, gradients, optimizer state sharded)
    reshard_after_forward: bool  # full: free each unit's gathered parameters after its forward
    mixed_precision: str | None  # full: "bf16"/"fp16" compute, fp32 gradient reduction
    cpu_offload: bool  # full: sharded parameters and gradients in CPU memory
    shard_units: tuple[str, ...] | None  # full: the modules sharded one by one
    dp_replicate: int  # full: > 1 is HSDP
    servers: int = 0  # parameter-server ranks holding server_plan's tables (0: none)
    server_plan: Any = None  # the tables' paths (a list, or a dict path -> "server")
    staleness: int = 0
    server_optimizer: str = "sgd"
    server_lr: float = 0.01
    dp_shares: Any = None  # uneven rows of one global batch per rank (macrogen.runtime.shares)
    dp_rebalance_every: int = 10  # dp_shares="measured": steps between two measurements
    dp_max_rows: Any = None  # each rank's cap in rows


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


def _shard(v: Any) -> str | None:
    return None if v in SHARD_MODES else 'None or "full" (FSDP)'


def _server_plan(v: Any) -> str | None:
    paths = list(v) if isinstance(v, (list, tuple, dict)) else None
    ok = v is None or (
        paths
        and all(isinstance(p, str) and p for p in paths)
        and (not isinstance(v, dict) or all(s == "server" for s in v.values()))
    )
    return None if ok else 'None or a list of table paths (["emb", "blocks.*.tags"])'


def _server_optimizer(v: Any) -> str | None:
    return None if v in ("sgd", "adagrad") else '"sgd" or "adagrad"'


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "shard": _shard,
    **{name: parallelize_arguments.CHECKS[name] for name in FSDP_ONLY},
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
    "servers": _steps(0),
    "server_plan": _server_plan,
    "staleness": _steps(0),
    "server_optimizer": _server_optimizer,
    "server_lr": _positive_number,
    **{name: uneven.CHECKS[name] for name in SHARE_ARGS},
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
    full = values["shard"] == "full"
    for name in REPLICATED_ONLY if full else FSDP_ONLY:
        if name in args:
            raise MacroError(
                f"{name} applies with replicated parameters (no shard=), and shard is 'full'"
                if full
                else f'{name} applies with shard="full" (FSDP), and shard is None',
                args[name].node,
            )
    if "shard" in args and redundant.may_be(ctx, args["shard"], "full"):
        redundant.fully_sharded(ctx, args["shard"], site.line, 'shard="full"')
    else:
        redundant.replicated(ctx, site.node, site.line)
    if "delay" in args and not values["overlap"]:
        raise MacroError(
            "delay= needs overlap=True: it is how late an overlapped round is applied",
            args["delay"].node,
        )
    if values["overlap"] and values["delay"] > values["sync_every"]:
        at = args.get("delay") or args["overlap"]
        raise MacroError(
            f"delay must be at most sync_every ({values['sync_every']}): one round in flight at a"
            f" time, not {values['delay']}",
            at.node,
        )
    _check_servers(args, values)
    _check_shares(args, values)
    for name in ("dp_shares", "dp_max_rows"):
        if isinstance(values[name], list):
            values[name] = tuple(values[name])
    if values["server_plan"] is not None:
        values["server_plan"] = tuple(values["server_plan"])
    units = values.pop("shard_units")
    return Spec(name=node.name.value, shard_units=None if units is None else tuple(units), **values)


def _check_servers(args: Mapping[str, Arg], values: dict[str, Any]) -> None:
    if not values["servers"]:
        for name in SERVER_ARGS:
            if name in args:
                raise MacroError(f"{name} applies with servers=S > 0", args[name].node)
        return
    at = args["servers"].node
    if values["server_plan"] is None:
        raise MacroError(
            f'servers={values["servers"]} needs the tables to serve: server_plan=["emb", ...]',
            at,
        )
    if values["shard"] is not None:
        raise MacroError('servers=S takes replicated dense parameters: leave out shard="full"', at)
    local = values["sync_every"] != 1 or values["outer"] is not None or values["overlap"]
    if local or values["accumulate"] != 1:
        raise MacroError(
            "servers=S takes neither local SGD (sync_every, outer, overlap) nor accumulate:"
            " a server table takes one forward per step",
            at,
        )


def _check_shares(args: Mapping[str, Arg], values: dict[str, Any]) -> None:
    """``dp_shares`` weights one backward per step by its rows: no accumulation, local SGD or
    parameter servers; its two companions need it."""
    if values["dp_shares"] is None:
        for name in SHARE_ARGS[1:]:
            if name in args:
                raise MacroError(
                    f'{name} applies with dp_shares="measured" (or fixed shares)', args[name].node
                )
        return
    local = values["sync_every"] != 1 or values["outer"] is not None or values["overlap"]
    if local or values["accumulate"] != 1 or values["servers"]:
        raise MacroError(
            "dp_shares weights one backward per step by its rows: it takes neither accumulate,"
            " local SGD (sync_every, outer, overlap) nor servers",
            args["dp_shares"].node,
        )


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """An overlapped round must be applied before the next one starts."""
    every, delay = arguments.get("sync_every", 1), arguments.get("delay", 1)
    if (
        arguments.get("overlap")
        and isinstance(every, int)
        and isinstance(delay, int)
        and delay > every
    ):
        return f"delay={delay} > sync_every={every}"
    return None


def _check(name: str, arg: Arg, ctx: Context) -> None:
    ctx.check_each_choice(name, arg, CHECKS[name])


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    assert isinstance(site.node, cst.ClassDef)
    decorator = ctx.import_from("macrogen.runtime", "data_parallel_class")
    if spec.shard == "full":
        return _fully_sharded(spec, site, ctx, decorator)
    servers: dict[str, Any] = {}
    if spec.servers:  # apply_server_tables makes the workers' GradientSync
        servers = {"server_config": ctx.import_from("macrogen.runtime", "ServerConfig")}
    config = ctx.import_from("macrogen.runtime", "DataParallelConfig")
    outer_sgd = None
    if spec.outer is not None:
        outer_sgd = ctx.import_from("macrogen.runtime", "OuterSGD")
    plan = rendered_decorator(
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
        shard=None,
        servers=spec.servers,
        server_plan=spec.server_plan,
        staleness=spec.staleness,
        server_optimizer=spec.server_optimizer,
        server_lr=spec.server_lr,
        dp_shares=spec.dp_shares,
        dp_rebalance_every=spec.dp_rebalance_every,
        dp_max_rows=spec.dp_max_rows,
        **servers,
    )
    return _decorated(ctx, site, plan)


def _decorated(ctx: Context, site: Site, plan: cst.Decorator) -> Expanded:
    assert isinstance(site.node, cst.ClassDef)
    # the class object itself keeps its name and identity
    return Expanded([decorated(ctx, site.node, plan)])


def _fully_sharded(spec: Spec, site: Site, ctx: Context, decorator: Any) -> Expanded:
    """``shard="full"``: the class's construction ends in FSDP2's apply, mg.parallelize's."""
    config = ctx.import_from("macrogen.runtime", "FullyShardedConfig")
    plan = rendered_decorator(
        "data_parallel.py.j2",
        name=spec.name,
        location=ctx.location(site.line),
        decorator=decorator,
        shard=spec.shard,
        fsdp_config=config,
        accumulate=spec.accumulate,
        reshard_after_forward=spec.reshard_after_forward,
        mixed_precision=spec.mixed_precision,
        cpu_offload=spec.cpu_offload,
        shard_units=spec.shard_units,
        dp_replicate=spec.dp_replicate,
    )
    return _decorated(ctx, site, plan)
