"""Parallel layouts: tensor x pipeline x data ways, the data-parallel mode, micro-batches,
and which of the repeated blocks are recomputed in backward (none, every N-th, all).

A layout is what ``mg.parallelize`` is asked for; the data-parallel degree is
what the other degrees leave of the world size. This module is pure (no torch):
the autotuner, ``macrogen plan`` and the macro's feasibility rule share it.

    Layout(tp=2, pp=1, dp="fsdp").name()          -> "tp2 pp1 fsdp mb1"
    Layout(dp="fsdp", recompute=1).name()         -> "tp1 pp1 fsdp mb1 recompute"
    Layout(dp="fsdp", recompute=2).name()         -> "tp1 pp1 fsdp mb1 recompute/2"
    Layout(ep=2).name()                           -> "tp1 pp1 replicate mb1 ep2"
    infeasible(Layout(tp=4), world=4, shape)      -> "layers.0.attn.n_head = 6 is not divisible by tp=4"

``problem`` is the one feasibility rule: ``macrogen plan``, the autotuner's search and the
``mg.parallelize`` macro's tuning constraint (``site_problem``) all ask it, so a layout one of
them offers is one the others run.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from macrogen.pipelining import units
from macrogen.vocabulary import DEFAULT_SCHEDULE, LAYOUT_DP_MODES

# What layout="auto" offers at expansion time, before the world size is known (it prunes).
AUTO_TP = (1, 2, 4, 8)
AUTO_PP = (1, 2, 4)
# Every how many blocks layout="auto" recomputes (Layout.recompute): none, all, every 2nd.
AUTO_RECOMPUTE = (0, 1, 2)
# The expert-parallel ways layout="auto" offers (a mixture of experts' probe prunes the rest)
AUTO_EP = (2, 4, 8)


@dataclass(frozen=True, order=True)
class Layout:
    tp: int = 1  # tensor-parallel ways
    pp: int = 1  # pipeline stages
    dp: str = "replicate"  # the data-parallel mode over the remaining ways
    microbatches: int = 1  # per step, through the pipeline (1 without one)
    # every how many repeated blocks one runs its forward again in backward, from the first:
    # 0 none, 1 all, 2 every 2nd (mg.parallelize's recompute=: None, "blocks", 2)
    recompute: int = 0
    # expert-parallel ways (a mixture of experts' experts dealt over ep of the data ranks)
    ep: int = 1

    def dp_size(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def name(self) -> str:
        name = f"tp{self.tp} pp{self.pp} {self.dp} mb{self.microbatches}"
        if self.recompute > 1:
            name = f"{name} recompute/{self.recompute}"
        elif self.recompute:
            name = f"{name} recompute"
        return f"{name} ep{self.ep}" if self.ep > 1 else name

    def describe(self, world: int) -> str:
        """``tp2 x dp2 (fsdp)``: the degrees as they multiply to the world size."""
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp} (mb{self.microbatches})")
        experts = f", experts over ep{self.ep}" if self.ep > 1 else ""
        parts.append(f"dp{self.dp_size(world)} ({self.dp}{experts})")
        again = f" + recompute 1/{self.recompute}" if self.recompute > 1 else " + recompute"
        return " x ".join(parts) + (again if self.recompute else "")

    def recomputed(self, blocks: int) -> float:
        """The share of ``blocks`` repeated blocks that are recomputed (indices 0, N, 2N, ...)."""
        if not self.recompute or blocks <= 0:
            return 0.0
        return -(-blocks // self.recompute) / blocks


_NAME = re.compile(r"tp(\d+) pp(\d+) (\w+) mb(\d+)( recompute(?:/(\d+))?)?(?: ep(\d+))?")


def parse(text: str) -> Layout:
    """The layout a ``name()`` spells; ValueError for anything else."""
    m = _NAME.fullmatch(text.strip())
    if m is None or m.group(3) not in LAYOUT_DP_MODES:
        raise ValueError(f"not a layout: {text!r} (expected e.g. 'tp2 pp1 fsdp mb1')")
    tp, pp, mb = int(m.group(1)), int(m.group(2)), int(m.group(4))
    every = 0 if m.group(5) is None else int(m.group(6) or 1)
    ep = int(m.group(7) or 1)
    if min(tp, pp, mb, ep) < 1 or (m.group(6) is not None and every < 2):
        raise ValueError(f"not a layout: {text!r} (degrees are >= 1, recompute/N has N >= 2)")
    return Layout(tp, pp, m.group(3), mb, recompute=every, ep=ep)


def microbatch_choices(pp: int) -> tuple[int, ...]:
    """Micro-batches worth trying for ``pp`` stages: none without a pipeline, else 2x and 4x."""
    return (1,) if pp == 1 else (2 * pp, 4 * pp)


def auto_choices() -> tuple[str, ...]:
    """Every layout ``layout="auto"`` stands for, by name; the default (all data parallel) first,
    each without recomputation, then each recomputing all blocks, then every 2nd; then the
    expert-parallel ones mg.parallelize runs, in the same order (a model without experts prunes
    them)."""
    out = []
    for recompute in AUTO_RECOMPUTE:
        for tp, pp, dp in itertools.product(AUTO_TP, AUTO_PP, LAYOUT_DP_MODES):
            for mb in microbatch_choices(pp):
                out.append(Layout(tp, pp, dp, mb, recompute).name())
    for recompute in AUTO_RECOMPUTE:
        for ep, tp, dp in itertools.product(AUTO_EP, AUTO_TP, LAYOUT_DP_MODES):
            layout = Layout(tp, dp=dp, recompute=recompute, ep=ep)
            if unsupported(layout) is None:
                out.append(layout.name())
    return tuple(out)


@dataclass(frozen=True)
class ModelShape:
    """What feasibility needs to know of the model (from a probe of the built model)."""

    blocks: int | None = None  # the repeated layer list's length; None: unknown
    # every size tp must divide: "layers.0.attn.n_head" -> 6, "layers.0.mlp.fc out features" -> 256
    divisible: Mapping[str, int] = field(default_factory=dict)
    rows: int = 0  # the global batch's rows (the model's input's first dim); 0: not known
    experts: int = 0  # experts per mixture-of-experts layer (ep must divide it); 0: none
    # the experts are modules in an nn.ModuleList (looped over in their block's forward), not
    # stacked (experts, ...) parameters: ep over them runs with tp=1 and dp "replicate" or "zero1"
    experts_listed: bool = False


def infeasible(layout: Layout, world: int, shape: ModelShape | None = None) -> str | None:
    """Why ``layout`` cannot run on ``world`` ranks, or None; the first reason found."""
    ways = layout.tp * layout.pp
    if world % ways:
        return f"tp x pp = {ways} does not divide the world size {world}"
    if layout.pp == 1 and layout.microbatches != 1:
        return "micro-batches without a pipeline (pp=1) are the same layout as mb1"
    if layout.dp != "replicate" and layout.dp_size(world) == 1:
        return f"one data-parallel rank: {layout.dp} is the same layout as replicate"
    if layout.ep > 1:
        reason = _experts_problem(layout, world, shape)
        if reason is not None:
            return reason
    shape = shape or ModelShape()
    for what, size in shape.divisible.items():
        if size % layout.tp:
            return f"{what} = {size} is not divisible by tp={layout.tp}"
    d, m = layout.dp_size(world), layout.microbatches
    if shape.rows and shape.rows % (d * m):
        into = f"{d} data rank{'s' * (d > 1)}" + (f" x {m} micro-batches" if layout.pp > 1 else "")
        return f"a batch of {shape.rows} rows does not split into {into} (equal shares)"
    if layout.recompute and shape.blocks == 0:
        return "no repeated blocks to recompute"
    if shape.blocks is not None and shape.blocks < layout.pp:
        return f"{shape.blocks} blocks cannot fill {layout.pp} pipeline stages"
    return None


def _experts_problem(layout: Layout, world: int, shape: ModelShape | None) -> str | None:
    d = layout.dp_size(world)
    if d % layout.ep:
        return f"ep={layout.ep} does not divide the {d} data rank{'s' * (d > 1)}"
    if shape is None:  # the model is not known yet (the macro's constraint, at expansion)
        return None
    if not shape.experts:
        return f"ep={layout.ep} needs experts: the model is no mixture of experts"
    if shape.experts % layout.ep:
        return f"ep={layout.ep} does not divide the {shape.experts} experts"
    if shape.experts_listed and (layout.tp > 1 or layout.dp == "fsdp"):
        return (
            f"ep={layout.ep} over experts in an nn.ModuleList runs with tp=1 and"
            ' dp="replicate" or "zero1" (stack them into one experts module for tp or fsdp)'
        )
    return None


def problem(
    layout: Layout,
    world: int,
    shape: ModelShape | None = None,
    arguments: Mapping[str, object] | None = None,
) -> str | None:
    """Why ``layout`` cannot train here, or None: the model's rules (``infeasible``) and, given
    the ``mg.parallelize`` site's ``arguments`` (what the program writes beside the degrees),
    what that site can run. Without ``arguments`` (a plan from a model's config, no program),
    the model's rules alone: ``unsupported`` then says what mg.parallelize can't run yet."""
    reason = infeasible(layout, world, shape)
    if reason is not None or arguments is None:
        return reason
    reason = unsupported(layout)
    if reason is None and layout.dp == "zero1" and "layout" in arguments:
        # the program's optimizer is sharded by hand (mg.shard_optimizer), never for a search
        reason = 'dp="zero1" under layout="auto": mg.shard_optimizer is not applied for it'
    if reason is None and layout.tp > 1 and arguments.get("tp_plan") is None:
        reason = f"tp={layout.tp} needs a tp_plan"
    if reason is None and layout.pp > 1:  # what the expansion would refuse
        values = {**arguments, "pp": layout.pp, "microbatches": layout.microbatches}
        reason = pipeline_problem(values)[0]
    if reason is None and layout.ep > 1:  # the site's other arguments ep does not go with
        values = {**arguments, **degrees(layout)}
        reason = experts_problem(values)[0]
    return reason


def degrees(layout: Layout) -> dict[str, Any]:
    """``layout`` as ``mg.parallelize``'s arguments (what ``layout="auto"``'s choice sets)."""
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "microbatches": layout.microbatches,
        "recompute": recompute_argument(layout.recompute),
        "ep": layout.ep,
    }


def site_problem(arguments: Mapping[str, object], world: int) -> str | None:
    """``problem`` for an ``mg.parallelize`` site's arguments with a candidate's values in place
    (the macro's tuning constraint); None for arguments that are no layout this module models."""
    layout = from_arguments(arguments)
    if layout is None:
        return None
    if layout.pp == 1:  # micro-batches change nothing without a pipeline
        layout = replace(layout, microbatches=1)
    return problem(layout, world, arguments=arguments)


def pipeline_problem(values: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """Why ``pp > 1`` can't go with these ``mg.parallelize`` arguments (and the arguments to
    blame), or None; the expansion refuses it, the searches prune it."""
    pp, m = values["pp"], values["microbatches"]
    schedule = values.get("schedule", DEFAULT_SCHEDULE)
    if values.get("servers", 0):
        return f"pp={pp} with servers=S is not supported", ("servers",)
    if values.get("accumulate", 1) != 1:
        return (
            f"pp={pp} takes accumulate=1: the pipeline's micro-batches accumulate already"
            " (microbatches=M)"
        ), ("accumulate",)
    per_rank = 2 if schedule == "interleaved" else 1
    problem = units.interleaving_problem(pp * per_rank, m, schedule, per_rank)
    if problem is None and schedule == "1f1b" and m < pp:
        problem = (
            f"pp={pp} with schedule 1f1b needs at least as many micro-batches as stages:"
            f" microbatches={m} (pass microbatches={pp} or more)"
        )
    return problem, ("microbatches", "schedule")


def experts_problem(values: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """Why ``ep > 1`` can't go with these ``mg.parallelize`` arguments (and the argument to
    blame), or None: the expansion refuses it, the searches prune it."""
    ep, tp = values.get("ep", 1), values.get("tp", 1)
    if ep == 1:
        return None, None
    modes = ("replicate",) if tp != 1 else ("replicate", "zero1", "fsdp")
    clashes = {
        "pp": values.get("pp", 1) != 1,
        "dp": values.get("dp", "replicate") not in modes,
        "dp_replicate": values.get("dp_replicate", 1) != 1,  # (HSDP: the experts' mesh has no room)
        "servers": values.get("servers", 0) != 0,
        "verify": bool(values.get("verify", False)),
        # the experts' gradients are divided by the data ranks: even shares only
        "dp_shares": values.get("dp_shares") is not None,
    }
    clash = next((name for name, found in clashes.items() if found), None)
    if clash is None:
        return None, None
    with_tp = f" (tp={tp})" if tp != 1 else ""
    return (
        f"ep={ep} with {clash}={values.get(clash)!r}{with_tp} is not supported yet: expert"
        ' parallelism runs with pp=1 and dp="replicate", "zero1", "fsdp" (tp=1) or "replicate"'
        " (tp > 1, the experts cut inside by the tp_plan)"
    ), clash


def unsupported(layout: Layout) -> str | None:
    """Why ``mg.parallelize`` cannot run a feasible layout yet (it is predicted, not measured)."""
    if layout.ep > 1 and layout.pp > 1:
        return "ep > 1 with pp > 1 is not supported by mg.parallelize yet"
    if layout.ep > 1 and layout.tp > 1 and layout.dp != "replicate":
        return (
            f'ep > 1 with tp > 1 runs with dp="replicate": {layout.dp} is not supported by'
            " mg.parallelize yet"
        )
    return None


# The largest world size the planner enumerates: its divisors come from trial division up to
# the square root (2^20 steps at most: well under a second)
MAX_WORLD = 2**40


def prime_factors(n: int) -> dict[int, int]:
    """``n``'s prime factors and their powers: 360 -> {2: 3, 3: 2, 5: 1}."""
    if n < 1:
        raise ValueError(f"not a positive whole number: {n}")
    factors: dict[int, int] = {}
    for p in (2, 3):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    p = 5
    while p * p <= n:  # 6k - 1 and 6k + 1: every prime above 3 is one of them
        for q in (p, p + 2):
            while n % q == 0:
                factors[q] = factors.get(q, 0) + 1
                n //= q
        p += 6
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending, from its prime factors (not a scan of 1..n)."""
    found = [1]
    for p, power in prime_factors(n).items():
        found = [d * p**k for d in found for k in range(power + 1)]
    return sorted(found)


def microbatch_splits(pp: int, rows: int) -> tuple[int, ...]:
    """Micro-batches for ``pp`` stages when a data rank trains ``rows`` rows: every divisor of
    the rows from ``pp`` up (1F1B keeps each stage busy only with at least one per stage);
    without a pipeline, one."""
    if pp == 1:
        return (1,)
    return tuple(m for m in divisors(rows) if m >= pp)


def enumerate_layouts(
    world: int, *, max_tp: int = 8, max_pp: int | None = None, rows: int = 0, experts: int = 0
) -> Iterator[Layout]:
    """Every layout whose degrees multiply to ``world`` (tp <= max_tp: one node's links).

    The degrees are the divisors of ``world`` (from its prime factors: a world of 2^40 ranks
    has 41). Micro-batches: with ``rows`` (the global batch) known, every split of a data
    rank's rows (``microbatch_splits``); else (or when they do not split) 2x and 4x the stages.
    With ``experts`` (a mixture of experts), each also with every ep > 1 dividing both the data
    ranks and the experts.
    """
    sizes = divisors(world)
    for tp in sizes:
        if tp > max_tp:
            break
        for pp in sizes:  # the divisors of world // tp are divisors of world
            if (max_pp is not None and pp > max_pp) or pp > world // tp:
                break
            if (world // tp) % pp:
                continue
            d = world // (tp * pp)
            splits = microbatch_splits(pp, rows // d) if rows and rows % d == 0 else ()
            # rows that do not split: the usual choices, each then infeasible with its reason
            splits = splits or microbatch_choices(pp)
            eps = [1] + [e for e in divisors(d) if e > 1 and experts and experts % e == 0]
            for dp in LAYOUT_DP_MODES:
                for mb in splits:
                    for recompute in AUTO_RECOMPUTE:
                        for ep in eps:
                            yield Layout(tp, pp, dp, mb, recompute, ep)


def from_arguments(arguments: Mapping[str, object]) -> Layout | None:
    """The layout an ``mg.parallelize`` site's arguments (a candidate's values in place) ask for.

    ``layout="auto"``'s tunable holds a layout's name; else the degrees are the
    arguments ``tp``, ``pp``, ``dp``, ``microbatches``, ``recompute`` (their defaults
    when absent).
    None when they are not a layout this module models (``dp="none"``, a bad value).
    """
    named = arguments.get("layout")
    if isinstance(named, str) and named != "auto":
        try:
            return parse(named)
        except ValueError:
            return None
    tp, pp = arguments.get("tp", 1), arguments.get("pp", 1)
    dp, mb = arguments.get("dp", "replicate"), arguments.get("microbatches", 1)
    recompute = recompute_every(arguments.get("recompute"))
    ep = arguments.get("ep", 1)
    degrees = (tp, pp, mb, ep)
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in degrees)
    if not ints or dp not in LAYOUT_DP_MODES or recompute is None:
        return None
    return Layout(tp, pp, dp, mb, recompute, ep)  # type: ignore[arg-type]


def recompute_every(value: object) -> int | None:
    """Every how many blocks ``mg.parallelize``'s ``recompute=value`` recomputes (None, "none": 0;
    "blocks": 1; an int N >= 1: N); None for a bad value. Mirrors
    ``macrogen.runtime.recompute.every`` (the runtime imports torch; the pass must not)."""
    if value in (None, "none"):
        return 0
    if value == "blocks":
        return 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def recompute_argument(every: int) -> str | int | None:
    """The ``recompute=`` value that recomputes every ``every``-th block (0: None)."""
    return None if every == 0 else "blocks" if every == 1 else every
