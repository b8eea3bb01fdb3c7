"""``mg.parallelize(model, ...)``: parallelism applied to a model that is already built.

    model = LlamaForCausalLM(config)                    model = LlamaForCausalLM(config)
    model = mg.parallelize(model, tp=2,           ->    model = _parallelize_l12(model)
                           tp_plan="hf")
                                                        # in the generated block after the imports:
                                                        def _parallelize_l12(model):
                                                            mesh = device_mesh(tp=2, ...)
                                                            apply_tensor_parallel(model, mesh, ...)
                                                            apply_data_parallel(model, mesh, ...)
                                                            return model

Unexpanded, the marker returns the model: the file is the serial program. The
model expression is the program's own code, kept as written. The generated
function names each step it takes, in a fixed order (tensor parallel, then data
parallel), on one mesh; ``macrogen.runtime.parallelize`` does the work.

Arguments (each may be ``define``d or a ``tunable``, but ``tp_plan``):
``tp`` (1), ``pp`` (1), ``dp`` ("replicate", "zero1", "fsdp" or "none"), ``tp_plan``
(None, "hf" or a dict ``{"path.*.layer": style}``), ``accumulate`` (1); for
replicate/zero1 ``bucket_mb`` (25) and ``compress`` (None, "bf16", "fp16"); for fsdp
``reshard_after_forward`` (True), ``mixed_precision`` (None, "bf16", "fp16"),
``cpu_offload`` (False), ``shard_units`` (None: the repeated layer list; or a list of
paths) and ``dp_replicate`` (1; R > 1: HSDP over R replicas); ``microbatches`` (1: per
step through a pipeline; nothing changes while pp is 1) and ``schedule`` ("1f1b",
"gpipe" or "interleaved": two stages per pipeline rank); ``servers`` (0; S > 0: the
plan's ``"server"`` tables live on the last S ranks, ``macrogen.runtime.param_server``) with
``staleness`` (0), ``server_optimizer`` ("sgd" or "adagrad") and ``server_lr`` (0.01);
``recompute`` (None; "blocks": the repeated blocks keep only their inputs and run their
forward again in backward, ``macrogen.runtime.recompute``; an int N: every N-th block, from
the first, 1 being "blocks"); ``verify`` (False; True: a serial copy of the model is made
first and the first forward's output is compared with its own, ``macrogen.runtime.first_forward``);
``ep`` (1; E > 1: a mixture of experts' experts dealt whole over E data ranks, tokens routed
to them by all-to-all, ``macrogen.runtime.expert_parallel``; with tp > 1 each expert is also
cut by the tp plan inside, ``macrogen.runtime.expert_tensor``);
``init`` (None; ``mg.load(path)`` or ``"model"``: a model built on the meta device gets storage
for this rank's shards after tensor parallel and FSDP, and its values from the checkpoint folder
or its own initializer, ``macrogen.runtime.materialize``; program code, kept in the call);
``dp_shares`` (None; "measured", "even" or one share per data rank, with dp "replicate" or
"zero1": each step's global batch is cut unevenly by ``mg.shard(model, batch)`` and each
rank's gradient weighted by its rows, ``macrogen.runtime.shares``) with ``dp_rebalance_every``
(10) and ``dp_max_rows`` (None); ``pp_split`` (None; "measured" or one speed per stage, with
pp > 1: stages of uneven blocks, ``macrogen.runtime.pipeline_speeds``).

``pp=N`` cuts the built model into N pipeline stages at run time, as ``@mg.pipeline``
would cut its class (``macrogen.runtime.parallelize_pipeline``): the training step is
``mg.pipeline_step(model, x, y, loss_fn)``. It goes with every dp mode, and with tp > 1:
the layers are sharded first, and each stage runs its parts on their local shards.

``layout="auto"`` stands for every layout (tp, pp, dp mode, micro-batches, recompute, ep) that
``macrogen autotune`` finds feasible for its world size: one tunable, keyed
``<site>.layout``, whose choices are layout names (``"tp2 pp1 fsdp mb1"``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import libcst as cst

from macrogen.autotune import layouts
from macrogen.autotune.layouts import experts_problem, pipeline_problem
from macrogen.macro import Arg, Context, Expanded, Form, MacroError, Site, TuningEnv, render
from macrogen.macros import redundant, uneven
from macrogen.vocabulary import (
    DEFAULT_SCHEDULE,
    DP_MODES,
    SCHEDULES,
    SERVER,
    STYLES,
    one_of,
    style_problem,
)

NAME = "parallelize"
FORMS: frozenset[Form] = frozenset({"call"})
USAGE = (
    'model = parallelize(model, tp=2, tp_plan={"layers.*.attn.q": "colwise", ...} or "hf",'
    ' dp="replicate")'
)
# the model expression and init= (mg.load(path) or "model") run in the program
CODE_ARGUMENTS = frozenset({"0", "init"})

SERVER_ONLY = ("staleness", "server_optimizer", "server_lr")

DEFAULTS: dict[str, Any] = {
    "model": None,
    "tp": 1,
    "pp": 1,
    "dp": "replicate",
    "tp_plan": None,
    "bucket_mb": 25,
    "compress": None,
    "accumulate": 1,
    "reshard_after_forward": True,
    "mixed_precision": None,
    "cpu_offload": False,
    "shard_units": None,
    "dp_replicate": 1,
    "microbatches": 1,
    "schedule": DEFAULT_SCHEDULE,
    "layout": None,
    "servers": 0,
    "staleness": 0,
    "server_optimizer": "sgd",
    "server_lr": 0.01,
    "recompute": None,
    "verify": False,
    "ep": 1,
    "init": None,
    "dp_shares": None,
    "dp_rebalance_every": 10,
    "dp_max_rows": None,
    "pp_split": None,
}
LAYOUT_ARGUMENTS = ("tp", "pp", "dp", "microbatches", "recompute", "ep")
FSDP_ONLY = (
    "reshard_after_forward",
    "mixed_precision",
    "cpu_offload",
    "shard_units",
    "dp_replicate",
)
NOT_FSDP = ("bucket_mb", "compress")


@dataclass(frozen=True)
class Spec:
    tp: int  # tensor-parallel ways
    pp: int  # pipeline ranks (1: the model is not cut)
    dp: str  # "replicate", "zero1", "fsdp" or "none"
    plan: tuple[tuple[str, str | tuple[str, int]], ...] | None  # path -> style, in order
    hf: bool  # tp_plan="hf": the plan the model ships
    bucket_mb: int | float
    compress: str | None
    accumulate: int
    reshard_after_forward: bool  # fsdp: free each unit's gathered parameters after its forward
    mixed_precision: str | None  # fsdp: "bf16"/"fp16" compute, fp32 gradient reduction
    cpu_offload: bool  # fsdp: sharded parameters and gradients in CPU memory
    shard_units: tuple[str, ...] | None  # fsdp: the modules sharded one by one
    dp_replicate: int  # fsdp: > 1 is HSDP
    microbatches: int  # per step, through a pipeline (pp > 1)
    schedule: str = "1f1b"  # the pipeline's schedule (pp > 1)
    servers: int = 0  # parameter-server ranks for the plan's "server" tables (0: none)
    server_plan: tuple[str, ...] = ()  # the paths planned "server"
    staleness: int = 0
    server_optimizer: str = "sgd"
    server_lr: float = 0.01
    # "blocks": the repeated blocks are recomputed in backward; an int N: every N-th of them
    recompute: str | int | None = None
    verify: bool = False  # the first forward compared with a serial copy's (then dropped)
    ep: int = 1  # expert-parallel ways: whole experts dealt over ep data ranks, tokens routed
    init: bool = False  # init= given: a meta-device model materialized with its values
    # uneven rows of one global batch per data rank (mg.shard): "even", "measured" or
    # proportions; None: each rank its own batch (macrogen.runtime.shares)
    dp_shares: str | tuple[float, ...] | None = None
    dp_rebalance_every: int = 10  # dp_shares="measured": steps between two measurements
    dp_max_rows: int | tuple[int, ...] | None = None  # each data rank's cap in rows
    # the stages' relative speeds, "measured" or given: uneven blocks per stage (None: even)
    pp_split: str | tuple[float, ...] | None = None


def _degree(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "an int >= 1"


def _dp(v: Any) -> str | None:
    return None if v in DP_MODES else one_of(DP_MODES)


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


def _precision(v: Any) -> str | None:
    return None if v in (None, "bf16", "fp16") else 'None, "bf16" or "fp16"'


def _units(v: Any) -> str | None:
    ok = v is None or (
        isinstance(v, (list, tuple)) and v and all(isinstance(p, str) and p for p in v)
    )
    return None if ok else 'None or a list of module paths (["layers.*"])'


def _mib(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    return None if ok else "a positive number of MiB"


def _compress(v: Any) -> str | None:
    return None if v in (None, "bf16", "fp16") else 'None, "bf16" or "fp16"'


def _count(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "an int >= 0"


def _recompute(v: Any) -> str | None:
    ok = layouts.recompute_every(v) is not None
    return None if ok else 'None, "none", "blocks" or an int N >= 1 (every N-th block)'


def _schedule(v: Any) -> str | None:
    return None if v in SCHEDULES else one_of(SCHEDULES)


def _server_optimizer(v: Any) -> str | None:
    return None if v in ("sgd", "adagrad") else '"sgd" or "adagrad"'


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "tp": _degree,
    "pp": _degree,
    "dp": _dp,
    "bucket_mb": _mib,
    "compress": _compress,
    "accumulate": _degree,
    "reshard_after_forward": _bool,
    "mixed_precision": _precision,
    "cpu_offload": _bool,
    "shard_units": _units,
    "dp_replicate": _degree,
    "microbatches": _degree,
    "schedule": _schedule,
    "servers": _count,
    "staleness": _count,
    "server_optimizer": _server_optimizer,
    "server_lr": _mib,
    "recompute": _recompute,
    "verify": _bool,
    "ep": _degree,
    **uneven.CHECKS,  # dp_shares, dp_rebalance_every, dp_max_rows, pp_split
}


def validate(site: Site, ctx: Context) -> Spec:
    args = site.args.bind(DEFAULTS, positional=("model",))
    if "model" not in args:
        raise MacroError(
            f"parallelize() takes the model first: {USAGE}", site.call or site.original
        )
    values = {k: args[k].value if k in args else d for k, d in DEFAULTS.items() if k != "model"}
    if "layout" in args:
        values.update(_auto_layout(site, args, ctx))
    for name, arg in args.items():
        if name in CHECKS:
            _check(name, arg, ctx)
    if values["pp"] != 1:
        _check_pipeline(args, values)
    for name in FSDP_ONLY if values["dp"] != "fsdp" else NOT_FSDP:
        if name in args:
            wanted = 'dp="fsdp"' if name in FSDP_ONLY else 'dp="replicate" or "zero1"'
            raise MacroError(
                f"{name} applies with {wanted}, and dp is {values['dp']!r}", args[name].node
            )
    if "dp" in args and redundant.may_be(ctx, args["dp"], "fsdp"):
        redundant.fully_sharded(ctx, args["dp"], site.line, 'dp="fsdp"')
    elif values["dp"] in ("replicate", "zero1"):
        redundant.replicated(ctx, site.node, site.line)
    plan, hf = _plan(args.get("tp_plan"))
    served = tuple(path for path, style in plan or () if style == SERVER)
    plan = tuple((p, s) for p, s in plan or () if s != SERVER) or None  # the tensor-parallel rest
    _check_servers(args, values, served, plan)
    uneven.check_shares(args, values)
    uneven.check_pp_split(args, values)
    tp_arg = args.get("tp") or args.get("layout")
    if (plan is None and not hf) and tp_arg is not None and values["tp"] != 1:
        raise MacroError(
            f"tp={values['tp']} needs a plan: tp_plan={{'path.to.layer': 'colwise', ...}} or"
            ' tp_plan="hf" (the plan a transformers model ships)',
            tp_arg.node,
        )
    if values["verify"] and (values["pp"] > 1 or values["servers"]):
        raise MacroError(
            "verify=True checks a model that is not cut into pipeline stages or served by"
            " parameter servers; check the plan at pp=1 (macrogen verify, docs/verify.md)",
            args["verify"].node,
        )
    _check_experts(args, values)
    if "init" in args:
        _check_init(args, values)
    return Spec(
        ep=values["ep"],
        tp=values["tp"],
        pp=values["pp"],
        dp=values["dp"],
        plan=plan,
        hf=hf,
        bucket_mb=values["bucket_mb"],
        compress=values["compress"],
        accumulate=values["accumulate"],
        reshard_after_forward=values["reshard_after_forward"],
        mixed_precision=values["mixed_precision"],
        cpu_offload=values["cpu_offload"],
        shard_units=None if values["shard_units"] is None else tuple(values["shard_units"]),
        dp_replicate=values["dp_replicate"],
        microbatches=values["microbatches"],
        schedule=values["schedule"],
        servers=values["servers"],
        server_plan=served,
        staleness=values["staleness"],
        server_optimizer=values["server_optimizer"],
        server_lr=values["server_lr"],
        recompute=None if values["recompute"] in (None, "none") else values["recompute"],
        verify=values["verify"],
        init="init" in args,
        dp_shares=_tuple(values["dp_shares"]),
        dp_rebalance_every=values["dp_rebalance_every"],
        dp_max_rows=_tuple(values["dp_max_rows"]),
        pp_split=_tuple(values["pp_split"]),
    )


def _tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _auto_layout(site: Site, args: dict[str, Arg], ctx: Context) -> dict[str, Any]:
    """``layout="auto"``: one tunable over every layout's name; the degrees of the chosen one."""
    arg = args["layout"]
    if arg.value != "auto" or arg.tunable is not None:
        raise MacroError(
            'layout must be "auto" (every feasible layout, chosen by macrogen autotune)', arg.node
        )
    given = [name for name in LAYOUT_ARGUMENTS if name in args]
    if given:
        raise MacroError(
            f'layout="auto" chooses tp, pp, dp, microbatches, recompute and ep; leave out'
            f" {', '.join(given)}",
            args[given[0]].node,
        )
    key = f"{site.qualname}.layout"
    choices = layouts.auto_choices()
    name = ctx.tunable(key, choices[0], choices, arg.node, site.line)
    # the site's arguments, as autotune's constraint sees them, hold the tunable's key
    cast("dict[str, Arg]", site.args.keywords)["layout"] = replace(arg, value=name, tunable=key)
    return layouts.degrees(layouts.parse(name))


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """A layout that can't run on env's world size, or that mg.parallelize can't run yet
    (autotune's one feasibility rule, which ``macrogen plan`` asks too)."""
    return layouts.site_problem(arguments, env.world_size)


def _check_pipeline(args: dict[str, Arg], values: dict[str, Any]) -> None:
    """``pp > 1``: what a run-time cut of the built model goes with, checked at expansion."""
    problem, blame = pipeline_problem(values)
    if problem is not None:
        at = next((args[n] for n in (*blame, "layout", "pp") if n in args), args["model"])
        raise MacroError(problem, at.node)


def _check_servers(
    args: dict[str, Arg], values: dict[str, Any], served: tuple[str, ...], plan: Any
) -> None:
    """``servers=S`` goes with "server" plan entries, tp=1 and dp "replicate" or "none"."""
    node = (args.get("servers") or args.get("tp_plan") or args["model"]).node
    if values["servers"] == 0:
        if served:
            raise MacroError(
                f'tp_plan plans {", ".join(served)} "server": pass servers=S (the ranks holding'
                " the tables)",
                node,
            )
        for name in SERVER_ONLY:
            if name in args:
                raise MacroError(f"{name} applies with servers=S > 0", args[name].node)
        return
    if not served:
        raise MacroError(
            f'servers={values["servers"]} needs tables to serve: tp_plan={{"path.to.embedding":'
            ' "server"}',
            node,
        )
    if values["tp"] != 1 or plan:
        raise MacroError(
            'servers=S with tensor parallelism is not supported yet: plan only "server"'
            " entries, tp=1",
            node,
        )
    if values["accumulate"] != 1:
        raise MacroError(
            "servers=S takes accumulate=1: a server table takes one forward per step", node
        )
    if values["dp"] not in ("replicate", "none"):
        raise MacroError(
            f'servers=S takes dp="replicate" or "none" (the dense rest of the model among the'
            f" workers), not {values['dp']!r}",
            node,
        )


def _check_experts(args: dict[str, Arg], values: dict[str, Any]) -> None:
    """``ep=E > 1``: expert parallelism over the data ranks, averaged data parallel (or FSDP)
    for the rest; with tp > 1 (the experts cut inside, ``runtime.expert_tensor``) averaged.
    The rule is ``layouts.experts_problem``, which the layout searches prune with."""
    problem, clash = experts_problem(values)
    if problem is not None:
        at = args.get(clash or "ep") or args.get("layout") or args.get("ep") or args["model"]
        raise MacroError(problem, at.node)


def _check_init(args: dict[str, Arg], values: dict[str, Any]) -> None:
    """``init=`` materializes a meta-device model after tensor parallel and FSDP (not yet
    with a pipeline's cut, parameter servers, verify's serial copy or experts cut by tp)."""
    blocked = [(n, w) for n, w in (("pp=", values["pp"] > 1), ("servers=", values["servers"] > 0),
                                   ("verify=", values["verify"]),
                                   ("ep= and tp > 1", values["ep"] > 1 and values["tp"] > 1))
               if w]  # fmt: skip
    if blocked:
        name = blocked[0][0]
        raise MacroError(
            f"init= (a meta-device model's values) goes with tp, dp and recompute; not yet with"
            f" {name}: build the model with its values for {name}",
            args["init"].node,
        )


def _check(name: str, arg: Arg, ctx: Context) -> None:
    ctx.check_each_choice(name, arg, CHECKS[name])


def _plan(arg: Arg | None) -> tuple[tuple[tuple[str, str | tuple[str, int]], ...] | None, bool]:
    """The plan's entries, every bad one reported at once (as one error listing them)."""
    if arg is None or arg.value is None:
        return None, False
    if arg.value == "hf":
        return None, True
    if not isinstance(arg.value, dict) or not arg.value:
        raise MacroError(
            'tp_plan must be "hf" or a non-empty dict {"path.to.layer": style}', arg.node
        )
    entries: list[tuple[str, str | tuple[str, int]]] = []
    problems: list[str] = []
    for path, style in arg.value.items():
        problem = _entry(path, style)
        if problem:
            problems.append(problem)
        else:
            entries.append((path, tuple(style) if isinstance(style, (tuple, list)) else style))
    if problems:
        raise MacroError("; ".join(problems), arg.node)
    return tuple(entries), False


def _entry(path: Any, style: Any) -> str | None:
    if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
        return f"tp_plan key {path!r} is not a dotted path (use '*' for every child)"
    problem = style_problem(style)
    if problem is None or style == SERVER:
        return None
    if isinstance(style, (tuple, list)):
        return f"{path}: {problem}"
    near = difflib.get_close_matches(str(style), (*STYLES, SERVER), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (
        f"{path}: {problem}{hint} (styles: {', '.join(STYLES)}; ('colwise', k) for k packed"
        f" blocks; {SERVER})"
    )


def _summary(spec: Spec) -> str:
    steps = []
    if spec.hf:
        steps.append(f"tensor parallel {spec.tp} ways (the model's own plan)")
    elif spec.plan is not None:
        steps.append(f"tensor parallel {spec.tp} ways ({len(spec.plan)} plan entries)")
    if spec.recompute in ("blocks", 1):
        steps.append("the repeated blocks recomputed in backward")
    elif spec.recompute:
        steps.append(f"every {_nth(spec.recompute)} repeated block recomputed in backward")
    if spec.servers:
        n = len(spec.server_plan)
        steps.append(f"{n} table{'s' * (n > 1)} on {spec.servers} parameter servers")
    if spec.pp > 1:
        steps.append(
            f"{spec.pp} pipeline stages ({spec.schedule}, {spec.microbatches} micro-batches)"
        )
    if spec.ep > 1:
        steps.append(f"experts dealt over {spec.ep} ranks (tokens routed by all-to-all)")
    if spec.dp == "fsdp":
        steps.append(
            "fully sharded data parallel (FSDP2)"
            + (f", {spec.dp_replicate} replicas (HSDP)" if spec.dp_replicate > 1 else "")
        )
    elif spec.dp != "none":
        shares = spec.dp_shares
        uneven = (
            "" if shares is None else f", {shares if isinstance(shares, str) else 'fixed'} shares"
        )
        steps.append(f"data parallel ({spec.dp}{uneven})")
    return ", then ".join(steps) or "the mesh only"


def _nth(n: object) -> str:
    """2 -> "2nd", 3 -> "3rd", 11 -> "11th"."""
    assert isinstance(n, int)
    last = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{'th' if 10 <= n % 100 <= 20 else last}"


def expand(site: Site, ctx: Context) -> Expanded:
    spec = validate(site, ctx)
    call = site.node
    assert isinstance(call, cst.Call)
    runtime = "macrogen.runtime"
    imports = [
        ctx.import_from(runtime, "parallelize_once"),
        ctx.import_from(runtime, "device_mesh"),
    ]
    if spec.plan is not None or spec.hf:
        imports.append(ctx.import_from(runtime, "apply_tensor_parallel"))
        if spec.hf:
            imports.append(ctx.import_from(runtime, "hf_plan"))
    if spec.recompute:
        imports.append(ctx.import_from("macrogen.runtime", "apply_recompute"))
    if spec.ep > 1:
        imports.append(ctx.import_from("macrogen.runtime", "apply_expert_parallel"))
    if spec.verify:
        imports.append(ctx.import_from(runtime, "serial_copy"))
        imports.append(ctx.import_from(runtime, "check_first_forward"))
    if spec.servers:
        imports.append(ctx.import_from("macrogen.runtime", "apply_server_tables"))
        imports.append(ctx.import_from("macrogen.runtime", "ServerConfig"))
    if spec.pp > 1:
        imports.append(ctx.import_from("macrogen.runtime", "apply_pipeline"))
    if spec.init:
        imports.append(ctx.import_from("macrogen.runtime", "check_init"))
        imports.append(ctx.import_from("macrogen.runtime", "apply_init"))
    if spec.dp == "fsdp":
        imports.append(ctx.import_from("macrogen.runtime", "apply_fully_sharded"))
        imports.append(ctx.import_from("macrogen.runtime", "FullyShardedConfig"))
    elif spec.dp != "none":
        if not spec.servers:  # with servers, apply_server_tables runs the workers' part
            imports.append(ctx.import_from(runtime, "apply_data_parallel"))
        imports.append(ctx.import_from("macrogen.runtime", "DataParallelConfig"))
    elif not spec.servers:
        imports.append(ctx.import_from(runtime, "no_data_parallel"))
    names = {imp.name: imp for imp in imports}
    fn = ctx.names.fresh(f"_parallelize_l{site.line}")
    helper = render(
        "parallelize.py.j2",
        fn=fn,
        location=ctx.location(site.line),
        summary=_summary(spec),
        tp=spec.tp,
        pp=spec.pp,
        planned=spec.plan is not None or spec.hf,
        plan=spec.plan,
        hf=spec.hf,
        dp=spec.dp,
        bucket_mb=spec.bucket_mb,
        compress=spec.compress,
        accumulate=spec.accumulate,
        reshard_after_forward=spec.reshard_after_forward,
        mixed_precision=spec.mixed_precision,
        cpu_offload=spec.cpu_offload,
        shard_units=spec.shard_units,
        dp_replicate=spec.dp_replicate,
        microbatches=spec.microbatches,
        schedule=spec.schedule,
        apply_pipeline=names.get("apply_pipeline", ""),
        apply_fully_sharded=names.get("apply_fully_sharded", ""),
        fsdp_config=names.get("FullyShardedConfig", ""),
        device_mesh=names["device_mesh"],
        parallelize_once=names["parallelize_once"],
        no_data_parallel=names.get("no_data_parallel", ""),
        apply_tensor_parallel=names.get("apply_tensor_parallel", ""),
        hf_plan=names.get("hf_plan", ""),
        apply_data_parallel=names.get("apply_data_parallel", ""),
        config=names.get("DataParallelConfig", ""),
        servers=spec.servers,
        server_plan=spec.server_plan,
        staleness=spec.staleness,
        server_optimizer=spec.server_optimizer,
        server_lr=spec.server_lr,
        apply_server_tables=names.get("apply_server_tables", ""),
        server_config=names.get("ServerConfig", ""),
        recompute=spec.recompute,
        recompute_nth="" if spec.recompute in (None, "blocks", 1) else _nth(spec.recompute),
        apply_recompute=names.get("apply_recompute", ""),
        verify=spec.verify,
        serial_copy=names.get("serial_copy", ""),
        check_first_forward=names.get("check_first_forward", ""),
        ep=spec.ep,
        apply_expert_parallel=names.get("apply_expert_parallel", ""),
        init=spec.init,
        check_init=names.get("check_init", ""),
        apply_init=names.get("apply_init", ""),
        dp_shares=spec.dp_shares,
        dp_rebalance_every=spec.dp_rebalance_every,
        dp_max_rows=spec.dp_max_rows,
        pp_split=spec.pp_split,
    )
    model = cst.Arg(call.args[0].value)  # the rest were expansion-time values, now in the helper
    kept = [model]
    if spec.init:  # init= is the program's own expression, run where it was written
        given = next(a for a in call.args if a.keyword is not None and a.keyword.value == "init")
        equal = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))
        kept.append(cst.Arg(given.value, keyword=cst.Name("init"), equal=equal))
    replacement = call.with_changes(
        func=cst.Name(fn), args=kept, whitespace_before_args=cst.SimpleWhitespace("")
    )
    return Expanded(replacement, helpers=(helper,))
