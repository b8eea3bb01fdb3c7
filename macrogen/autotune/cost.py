"""Step time of a layout: compute from a serial probe, collectives on an alpha-beta network.

Pure functions. Per step, on one rank (D = data ways, m = micro-batches):

- compute: the serial step / D (on CPU ranks, the step at one intra-op
  thread: torchrun's default for several ranks), the planned layers' share / tp,
  the blocks' share / pp (x 1 + r/3 when a share r of the blocks is recomputed: one
  more forward of those); the blocks' fixed cost per call (``Profile.block_call_s``:
  Python, dispatch, kernel launches) is paid whole by every micro-batch, whatever
  its rows, and so is what checkpointing adds to a recomputed block's call
  (``Profile.recompute_call_s``: the RNG state saved, the forward's calls again);
  the optimizer step (``Profile.optimizer_s``) updates the rank's parameters,
  / D only when zero1 or fsdp shard them; all but the optimizer times the
  pipeline's bubble (m + pp - 1) / m (1F1B), or, where ranks share cores
  (ranks over cores = the slowdown s), times max(bubble, s): a rank waiting in
  the bubble leaves its core to another's work;
- tensor parallel: Megatron's 4 all-reduces per block (2 forward, 2 backward;
  4 + 2r when a share r of the blocks is recomputed) of one block's output for
  the rank's micro-batch, over tp ranks (sequence parallel's reduce-scatter +
  all-gather moves the same bytes);
- data parallel: replicate and zero1 all-reduce the rank's gradients once
  (a ring moves 2x the parameter bytes); fsdp all-gathers them twice and
  reduce-scatters once (3x), one collective per unit (each block, and the root);
  under a pipeline it gathers twice per micro-batch (2m + 1);
- pipeline: each micro-batch's activations forward and gradient back across a cut;
- expert parallelism (ep): each MoE layer's 4 all-to-alls (tokens to their experts and back,
  forward and backward; 2 more, and the counts' exchange, where its block is recomputed) of
  the rank's routed bytes (its (token, slot) pairs x hidden x element size:
  ``probe_experts.routed_bytes``, what ``expert_routing.Traffic`` counts), over its expert
  group of ep ranks; the experts' gradients all-reduced (fsdp: gathered and reduced)
  over their d / ep replicas, the rest's over all d; the experts' fixed cost per call
  (``Profile.expert_call_s``) / ep: a rank runs E / ep experts a layer, not all E (their
  rows' work is / d as without ep: each rank's experts get the group's pairs for them).

A collective over n ranks costs ring steps x (alpha + bytes per step / beta)
on the slowest link its group crosses: tensor groups are contiguous ranks
(one node while tp <= ranks per node), data and pipeline groups are strided.
Nothing overlaps (gloo on CPU blocks the computing thread); ``fit`` scales the
compute and the communication terms to measured step times, then fits two fixed
costs the bytes do not explain: each FSDP unit's per step (``Step.units``:
FSDP2's hooks, copies in and out of its flat buffers, three collectives -- under a
pipeline 2m + 1, counted as (2m + 1) / 3 units, each x (D + tp - 1): itself, its ring's
D - 1 steps, tp - 1 for DTensor parameters; on a
CPU they cost milliseconds) from four measured layouts, and each other collective call's (``Step.calls``: 4 + 2r per block and micro-batch under tp, 1
all-reduce for replicate, 2 sends per micro-batch under pp) from six.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from macrogen.autotune import units
from macrogen.autotune.layouts import Layout
from macrogen.autotune.memory import Profile, pp_share, tp_share


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes per second
    latency: float = 5e-6  # seconds per message (alpha)
    # fixed costs before any are fitted (``Fit``): a collective call's, an FSDP unit's per step
    # (a GPU's: a kernel launch, FSDP2's hooks and copies)
    call_s: float = 2e-5
    unit_s: float = 1e-4


@dataclass(frozen=True)
class Machine:
    per_node: int  # ranks sharing the fast link
    intra: Link
    inter: Link
    slowdown: float = 1.0  # compute: ranks over cores on a shared CPU
    one_thread: bool = False  # several ranks run one intra-op thread each (torchrun on CPU)


# gloo on one host (loopback TCP), from bench/collectives.py on the development machine; its
# fixed costs from bench/layout_autotune.py's fits there (FSDP2's hooks on CPU take ms)
GLOO_LOCAL = Link("gloo", bandwidth=0.7e9, latency=3.7e-4, call_s=3e-4, unit_s=5e-3)


def parse_links(text: str, option: str = "--link") -> tuple[Link, Link]:
    """``nvlink:900GB/s,ib:50GB/s`` -> (within a node, across nodes); one link: both.
    ``units.UsageError`` naming ``option`` for anything else."""
    links = []
    for part in text.split(","):
        name, colon, rate = part.strip().partition(":")
        wrong = units.UsageError(
            f"{option} {part.strip()!r}: expected NAME:BANDWIDTH such as nvlink:900GB/s"
        )
        if not colon or re.fullmatch(r"[A-Za-z][\w-]*", name.strip(), re.ASCII) is None:
            raise wrong
        try:
            links.append(Link(name.strip(), units.bandwidth(option, rate)))
        except units.UsageError:
            raise wrong from None
    if len(links) > 2:
        raise units.UsageError(
            f"{option} {text!r}: at most two links (within a node, across nodes)"
        )
    return links[0], links[-1]


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (link.latency + nbytes / n / link.bandwidth)


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Gathering (or reduce-scattering) ``nbytes`` in total over n ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes / n / link.bandwidth)


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """Each of n ranks sending ``nbytes`` of its own, an n-th to each peer (n - 1 messages)."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes / n / link.bandwidth)


def send_s(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class Step:
    compute: float
    tensor: float
    data: float
    pipeline: float
    # collectives and sends per step but FSDP's, and FSDP units gathered and reduced per step,
    # each x the machine's slowdown (their fixed costs are fitted: ``Fit``)
    calls: float = 0.0
    units: float = 0.0
    # the links' fixed costs per call and per unit, until measurements fit them (``Fit``)
    call_s: float = 0.0
    unit_s: float = 0.0
    experts: float = 0.0  # expert parallelism's routing all-to-alls

    @property
    def communication(self) -> float:
        return self.tensor + self.data + self.pipeline + self.experts

    @property
    def fixed(self) -> float:
        return self.calls * self.call_s + self.units * self.unit_s

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.fixed


def predict(profile: Profile, layout: Layout, world: int, machine: Machine) -> Step:
    d, tp, pp, m = layout.dp_size(world), layout.tp, layout.pp, layout.microbatches
    bubble = (m + pp - 1) / m
    block = profile.block_s / profile.step_s if profile.step_s else 0.0
    recomputed = layout.recomputed(profile.blocks)  # the share of the blocks run twice
    again = 1.0 + recomputed / 3  # block_s is forward + backward (3 forwards' time)
    serial = profile.step_s
    if machine.one_thread and world > 1 and profile.step_one_thread_s:
        serial = profile.step_one_thread_s
    threads = serial / profile.step_s if profile.step_s else 1.0  # the probe's times -> serial's
    # the blocks' fixed cost per call (every block of the stage, every micro-batch) does not
    # shrink with the rows a rank computes, nor with tp; the rest of their time does
    fixed = min(profile.blocks * profile.block_call_s * threads, serial * block)
    per_row = (serial * block - fixed) / d * tp_share(profile, tp)
    if profile.recompute_call_s is None:  # not measured: the forward again, a third of it all
        blocks_s = (per_row + fixed * m) * again
    else:  # the rows' forward again, and what a checkpointed call adds, per micro-batch
        added = profile.recompute_call_s * threads * profile.blocks * recomputed
        blocks_s = per_row * again + (fixed + added) * m
    # ep: a rank runs E / ep experts a layer, so their fixed cost per call shrinks by ep
    # (at most the experts' own share of the step, as the probe timed them in it)
    experts_fixed = min(profile.expert_call_s, profile.expert_s) * threads
    blocks_s = max(0.0, blocks_s - experts_fixed * (1 - 1 / layout.ep) * m)
    # the optimizer step updates the rank's parameters: all of a replica's, unless sharded
    optimizer = min(profile.optimizer_s * threads, serial * (1 - block))
    rest = serial * (1 - block) - optimizer
    optimizer *= tp_share(profile, tp) * pp_share(profile, pp)
    optimizer /= d if layout.dp in ("zero1", "fsdp") else 1
    compute = (
        (blocks_s / pp + rest / d * tp_share(profile, tp))
        # ranks that share cores run the pipeline's idle slots with another rank's work: a
        # step takes the longer of the bubble's critical path and all ranks' work over the cores
        * max(bubble, machine.slowdown)
        + optimizer * machine.slowdown
    )
    tp_link = machine.intra if tp <= machine.per_node else machine.inter
    # a stage's d x tp ranks are consecutive: its data groups stay in a node when they fit
    dp_link = machine.intra if tp * d <= machine.per_node else machine.inter
    pp_link = machine.intra if world <= machine.per_node else machine.inter
    message = profile.message_bytes / d / m  # one block's output, one micro-batch of this rank
    blocks = profile.blocks / pp if profile.blocks else 0.0
    per_block = 4 + 2 * recomputed  # a recomputed forward all-reduces twice again
    tensor = per_block * blocks * m * all_reduce_s(message, tp, tp_link)
    grads = profile.param_bytes * tp_share(profile, tp) * pp_share(profile, pp)
    # ep: the rank's experts (1/ep of them) are reduced over their d / ep replicas, the rest
    # over all d ranks
    ep, moe_layers = layout.ep, profile.expert_layers if layout.ep > 1 else 0
    experts = profile.expert_bytes / ep if ep > 1 else 0.0
    others = grads - (profile.expert_bytes if ep > 1 else 0.0)
    replicas = d // ep if ep > 1 else 1  # (without ep, no collective of their own)
    fsdp_units = 0.0
    calls = per_block * blocks * m if tp > 1 else 0.0
    if layout.dp == "fsdp":  # per unit (each block, then the root): 2 all-gathers, 1 reduce-scatter
        # (each experts module is a unit of its own under ep, over its replicas)
        units = (profile.blocks / pp if profile.blocks else 0.0) + 1 + moe_layers
        # under a pipeline schedule every micro-batch gathers each unit again in its forward
        # (resharded after it) and in its backward; the gradients are reduced once, at the end
        collectives = 2 * m + 1
        data = collectives * (
            all_gather_s(others, d, dp_link)
            + all_gather_s(experts, replicas, dp_link)
            + (units - 1) * (d - 1) * dp_link.latency
        )
        # per unit and collective: its own hooks and copies (1), a wait per ring step over
        # the D - 1 data peers (a rank may be descheduled), and under tp FSDP2 over DTensor
        # parameters, tp - 1 more: chosen from five 4-rank runs (every layout held out: 242
        # of 255 within 25%, against 237 for D - 1 alone, which left tp x fsdp -3% to -31%)
        fsdp_units = (units - moe_layers) * collectives / 3 * (d + tp - 1)
        # ep: each experts module is a unit over its d / ep replicas (its waits: their ring's)
        fsdp_units += moe_layers * collectives / 3 * (replicas + tp - 1)
    else:
        data = all_reduce_s(others, d, dp_link) + all_reduce_s(experts, replicas, dp_link)
        calls += 1 if d > 1 else 0.0
        calls += moe_layers if replicas > 1 else 0  # one all-reduce per experts module
    pipeline = 2 * m * send_s(message / tp, pp_link) if pp > 1 else 0.0
    calls += 2 * m if pp > 1 else 0.0
    # ep: each MoE layer's 4 all-to-alls of this rank's routed pairs over its expert group
    # (an expert group is ep of the data ranks), and the per-expert counts' exchange first;
    # a recomputed layer's forward routes again in backward (its counts and 2 all-to-alls)
    routing = 0.0
    if moe_layers:
        pairs = profile.routed_bytes / moe_layers / d  # one way, one layer, this rank's rows
        routing = (4 + 2 * recomputed) * moe_layers * all_to_all_s(pairs, ep, dp_link)
        calls += (5 + 3 * recomputed) * moe_layers
    # fixed costs are CPU work and waits on descheduled ranks: ranks sharing cores pay more
    s = machine.slowdown
    # the priors of the links the calls cross: tp's all-reduces, else replicate's, else the sends
    call_link = tp_link if tp > 1 else dp_link if d > 1 else pp_link
    return Step(
        compute,
        tensor,
        data,
        pipeline,
        calls * s,
        fsdp_units * s,
        call_link.call_s,
        dp_link.unit_s,
        routing,
    )


@dataclass(frozen=True)
class Fit:
    """Scales of the compute and communication terms, and the fixed costs of an FSDP unit and
    of a collective call, fitted to measured step times."""

    compute: float = 1.0
    communication: float = 1.0
    # seconds per FSDP unit and step beyond its collectives' bytes (None: the link's prior)
    per_unit: float | None = None
    # seconds per other collective or send beyond the alpha-beta model (None: the link's)
    per_call: float | None = None

    def __call__(self, step: Step) -> float:
        return (
            self.compute * step.compute
            + self.communication * step.communication
            + (step.unit_s if self.per_unit is None else self.per_unit) * step.units
            + (step.call_s if self.per_call is None else self.per_call) * step.calls
        )


def fit(points: Sequence[tuple[Step, float]]) -> Fit:
    """Least squares of measured = a x compute + b x communication (+ c x FSDP units
    + e x calls), all >= 0, in relative errors (each layout's row over its measured
    time): the fast layouts, among which the search decides, weigh as much as the slow.

    The fixed costs (Python hooks, copies, a thread's wake-up: on a shared CPU they
    outweigh the bytes) join from four points (units) and six (calls) on, so that
    there are more points than terms, two of which pay the cost; until then the
    link's priors stand for them.
    One point fits one common scale of compute and communication.
    """
    points = [(s, t) for s, t in points if t > 0]
    if not points:
        return Fit()
    # a fixed cost is fitted from enough points, two or more of which pay it (no FSDP layout
    # measured says nothing of an FSDP unit's cost: its prior stands)
    units = len(points) >= 4 and sum(s.units > 0 for s, _ in points) >= 2
    calls = len(points) >= 6 and sum(s.calls > 0 for s, _ in points) >= 2
    # what the fixed costs not fitted take of each measurement, at the links' priors
    rest = [
        (s, t - (0.0 if units else s.units * s.unit_s) - (0.0 if calls else s.calls * s.call_s))
        for s, t in points
    ]
    variable = sum(s.compute + s.communication for s, _ in points)
    common = max(sum(r for _, r in rest), 0.0) / max(variable, 1e-12)
    if len(points) < 2 or common <= 0:
        return Fit(common, common) if common > 0 else Fit()
    columns: list[Callable[[Step], float]] = [lambda s: s.compute, lambda s: s.communication]
    if units:
        columns.append(lambda s: s.units)
    if calls:
        columns.append(lambda s: s.calls)
    rows = [[c(s) / t for c in columns] for s, t in points]
    found = nonnegative_least_squares(rows, [r / t for (_, r), (_, t) in zip(rest, points)])
    if found is None or found[0] <= 0:  # no compute: the points explain noise, not the machine
        return Fit(common, common)
    fixed = iter(found[2:])  # the fitted fixed costs, in the columns' order
    return Fit(found[0], found[1], next(fixed) if units else None, next(fixed) if calls else None)


def nonnegative_least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """min |A x - y| over x >= 0 for a few columns: the best of every subset's free fit."""
    k = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for active in itertools.product((False, True), repeat=k):
        chosen = [j for j in range(k) if active[j]]
        if not chosen:
            continue
        solved = _least_squares([[r[j] for j in chosen] for r in rows], ys)
        if solved is None or min(solved) < 0:
            continue
        x = [0.0] * k
        for j, v in zip(chosen, solved):
            x[j] = v
        residual = sum((sum(a * b for a, b in zip(r, x)) - y) ** 2 for r, y in zip(rows, ys))
        if best is None or residual < best[0] - 1e-18:
            best = (residual, x)
    return None if best is None else best[1]


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """The normal equations, by Gaussian elimination; None when they are singular."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]
