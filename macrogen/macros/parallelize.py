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
parallel), on one mesh; ``macrogen.runtime.parallelize`` does the work. The arguments are
checked into a ``Spec`` by ``macrogen.macros.parallelize_arguments``; this module renders it.

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

from collections.abc import Mapping

import libcst as cst

from macrogen.autotune import layouts
from macrogen.macro import Context, Expanded, Form, Site, TuningEnv, render
from macrogen.macros.parallelize_arguments import USAGE as USAGE
from macrogen.macros.parallelize_arguments import Spec, validate

NAME = "parallelize"
FORMS: frozenset[Form] = frozenset({"call"})
# the model expression and init= (mg.load(path) or "model") run in the program
CODE_ARGUMENTS = frozenset({"0", "init"})


def tuning_constraint(arguments: Mapping[str, object], env: TuningEnv) -> str | None:
    """A layout that can't run on env's world size, or that mg.parallelize can't run yet
    (autotune's one feasibility rule, which ``macrogen plan`` asks too)."""
    return layouts.site_problem(arguments, env.world_size)


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
