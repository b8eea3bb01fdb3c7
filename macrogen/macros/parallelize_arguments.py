"""The arguments of an ``mg.parallelize(model, ...)`` call, checked at expansion into a
``Spec``: each one's values (a ``tunable``'s every choice), the combinations that go together
(pipelines, parameter servers, experts, ``init=``), ``layout="auto"``'s one tunable, and the
plan's entries, every bad one reported at once. ``macrogen.macros.parallelize`` renders the
apply step from the ``Spec``; ``macrogen.macros.data_parallel`` shares the FSDP checks.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from macrogen.autotune import layouts
from macrogen.autotune.layouts import experts_problem, pipeline_problem
from macrogen.macro import Arg, Context, MacroError, Site
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

USAGE = (
    'model = parallelize(model, tp=2, tp_plan={"layers.*.attn.q": "colwise", ...} or "hf",'
    ' dp="replicate")'
)
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
    """``init=`` materializes a meta-device model after tensor parallel, the pipeline's cut and
    FSDP (not yet with parameter servers, verify's serial copy or experts cut by tp)."""
    blocked = [(n, w) for n, w in (("servers=", values["servers"] > 0),
                                   ("verify=", values["verify"]),
                                   ("ep= and tp > 1", values["ep"] > 1 and values["tp"] > 1))
               if w]  # fmt: skip
    if blocked:
        name = blocked[0][0]
        raise MacroError(
            f"init= (a meta-device model's values) goes with tp, pp, dp, ep and recompute; not"
            f" yet with {name}: build the model with its values for {name}",
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
