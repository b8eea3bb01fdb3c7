"""Step time and memory per rank of a layout at scale, from a ``ModelSpec`` and a device set.

Pure functions. A layout's ranks are ordered as ``mg.parallelize``'s mesh orders them
(pipeline x data x tensor: a stage's ranks are consecutive, a tensor group is
consecutive ranks, one node while tp <= GPUs per node). Per step, with D data ranks,
m micro-batches and T tokens per micro-batch and data rank:

- **memory** (bytes on a rank, the busiest stage): the model states as the ZeRO paper
  counts them for mixed-precision Adam, 2 + 2 + 12 bytes per parameter (bf16
  parameters and gradients, fp32 master copy and moments) of the rank's parameters
  (its stage's blocks / tp, the embedding on the first stage and the head on the last,
  vocabulary-split / tp): replicate 16, zero1 4 + 12/D, fsdp 16/D plus four units'
  bf16 buffers (one gathered, one prefetched, a unit's gradients and their
  reduce-scatter input); an FSDP pipeline stage stays gathered through its
  micro-batches with its gradients whole until the last (4 + 12/D, as ZeRO-2).
  Activations: what autograd saves per token and block (measured on meta tensors),
  / tp (sequence parallel: Megatron's and torchtitan's tensor parallelism shards the
  norms' and the residual's too), x T x the stage's blocks x the micro-batches 1F1B
  keeps in flight on the first stage, min(pp, m); a recomputed block keeps its input
  only, and one block's activations live again while it is recomputed; the last
  stage holds the head's logits and loss for one micro-batch. Each rank is assumed to
  build only its shards (a meta-device build: no whole-model copy).
- **time**: each stage's FLOPs per micro-batch (/ tp) at the device's matrix-multiply
  efficiency (lower for the narrow matrices a large tp leaves), plus the element-wise
  traffic (twice the activations) at its memory bandwidth; tensor parallelism's 4
  collectives per block and micro-batch (2 more per recomputed block) of T x hidden
  bf16 values, on the critical path; with ``ep``, each MoE block's 4 all-to-alls (tokens
  to their experts and back, forward and backward) of T x top_k x hidden bf16 values (each
  tensor rank routes its data rank's tokens over its own expert group; the experts' partial
  sums are all-reduced over the tensor group as the MLP's are), the experts' parameters
  / (tp x ep) in memory; 1F1B's (m + pp - 1) micro-batch slots; sends of
  one micro-batch's activations between stages; data parallelism's collectives in
  bf16, overlapped with the compute they can hide behind: the gradients' all-reduce
  (replicate; zero1's reduce-scatter + all-gather moves the same bytes) behind the
  last micro-batch's backward, FSDP's per-unit all-gathers behind the previous unit's
  forward and backward and its reduce-scatters behind the next unit's backward (an
  FSDP stage: on the first micro-batch's forward and the last one's backward); the
  optimizer step streaming its states through memory.
- **collectives**: NCCL's ring, (n - 1) steps for an all-gather or reduce-scatter, each
  paying NCCL's per-step latency (within a node or across, ``devices``) and its share
  of the bytes at the slowest link the ring crosses.

Heterogeneous device sets: each stage or data rank runs at its own device's speed.
``even`` splits rows and blocks evenly (every framework's default: the slowest
device sets the pace); ``adapted`` gives each data rank rows in proportion to its
speed and each stage blocks in proportion to its devices' speed, where memory allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from macrogen.autotune.devices import COLLECTIVE_S, DeviceKind, DeviceSet
from macrogen.autotune.layouts import Layout
from macrogen.autotune.model_spec import ModelSpec
from macrogen.autotune.probe_experts import routed_bytes

# ZeRO's mixed-precision Adam: bytes per parameter of bf16 weights, bf16 gradients, and the
# optimizer's fp32 master weights, momentum and variance (K = 12)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12
# the optimizer step reads and writes every state it keeps: fp32 master, m, v (read and
# written) and the bf16 gradient and weight: about 28 bytes moved per parameter
STEP_TRAFFIC = 28
# the inner width below which a matrix multiply runs visibly under its peak: eff x k / (k + K0)
NARROW = 128
# of a device's memory, what a plan leaves for the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation (a layout needing more than the rest is over memory)
RESERVE = 0.10


@dataclass(frozen=True)
class Memory:
    """Bytes on the busiest rank."""

    weights: float
    grads: float
    optimizer: float
    buffers: float  # FSDP's gathered units, or a pipeline stage's gathered parameters
    activations: float

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.buffers + self.activations


@dataclass(frozen=True)
class Step:
    """Seconds of one step on the slowest data rank, by what they are spent on."""

    compute: float  # the stages' FLOPs and element-wise traffic, with the pipeline's bubble
    tensor: (
        float  # tensor parallelism's collectives, expert parallelism's all-to-alls (not overlapped)
    )
    pipeline: float  # sends between stages
    data: float  # data parallelism's collectives, what compute did not hide
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.tensor + self.pipeline + self.data + self.optimizer


@dataclass(frozen=True)
class Split:
    """How work is divided: rows per data rank and blocks per stage."""

    rows: tuple[float, ...]  # sequences per step, per data rank
    blocks: tuple[int, ...]  # repeated blocks per pipeline stage


@dataclass(frozen=True)
class Prediction:
    step: Step
    memory: Memory  # the busiest rank's
    split: Split
    over: str | None  # a rank over its device's memory, and by how much; None: all fit
    mfu: float  # model FLOPs / (step x world x each device's bf16 peak)


def predict(
    spec: ModelSpec, layout: Layout, devices: DeviceSet, rows: int, split: Split | None = None
) -> Prediction:
    """The layout with ``rows`` sequences of ``spec.seq`` tokens per step, split as ``split``
    (None: evenly)."""
    world = devices.world
    d, pp = layout.dp_size(world), layout.pp
    split = split or even_split(spec, layout, world, rows)
    stage_kinds = _stage_kinds(layout, devices)
    times, worst_memory, over = [], None, None
    done: dict[tuple[object, ...], tuple[Step, list[Memory]]] = {}
    for j in range(d):
        chain = [stage_kinds[s][j] for s in range(pp)]
        key = (*(k.name for k in chain), split.rows[j])  # data ranks alike are computed once
        if key not in done:
            done[key] = _data_rank(spec, layout, devices, chain, split, split.rows[j])
        time_j, memories = done[key]
        times.append(time_j)
        for s, (mem, kind) in enumerate(zip(memories, chain)):
            if worst_memory is None or mem.total > worst_memory.total:
                worst_memory = mem
            usable = kind.memory * (1 - RESERVE)
            if over is None and mem.total > usable:
                over = (
                    f"stage {s} on {kind.name} needs {mem.total / 1e9:.1f} GB of its"
                    f" {usable / 1e9:.0f} GB ({RESERVE:.0%} of {kind.memory / 1e9:.0f} GB kept"
                    " for the CUDA context, NCCL and fragmentation)"
                )
    assert worst_memory is not None
    slowest = max(times, key=lambda t: t.total)
    tokens = rows * spec.seq
    peak = sum(n * k.peak("bf16") for n, k in devices.groups)
    mfu = spec.model_flops_per_token * tokens / (slowest.total * peak) if slowest.total else 0.0
    return Prediction(slowest, worst_memory, split, over, mfu)


def even_split(spec: ModelSpec, layout: Layout, world: int, rows: int) -> Split:
    d = layout.dp_size(world)
    return Split((rows / d,) * d, _blocks_even(spec.layers, layout.pp))


def adapted_split(spec: ModelSpec, layout: Layout, devices: DeviceSet, rows: int) -> Split:
    """Blocks per stage in proportion to its slowest device's speed, rows per data rank in
    proportion to its pipeline's speed (in whole micro-batches), where memory allows."""
    d, pp, m = layout.dp_size(devices.world), layout.pp, layout.microbatches
    stage_kinds = _stage_kinds(layout, devices)
    speed = [min(_speed(k, layout.tp, spec) for k in stage_kinds[s]) for s in range(pp)]
    blocks = _proportional(spec.layers, speed, minimum=1)
    # each data rank's pipeline runs at its slowest stage's pace (per block it holds)
    pace = [
        1.0 / max(blocks[s] / _speed(stage_kinds[s][j], layout.tp, spec) for s in range(pp))
        for j in range(d)
    ]
    shares = _proportional(rows // m, pace, minimum=1) if rows % m == 0 else None
    split = Split(tuple(float(n * m) for n in shares) if shares else (rows / d,) * d, tuple(blocks))
    fits = predict(spec, layout, devices, rows, split).over is None
    return split if fits else even_split(spec, layout, devices.world, rows)


def _data_rank(
    spec: ModelSpec,
    layout: Layout,
    devices: DeviceSet,
    chain: list[DeviceKind],
    split: Split,
    rows: float,
) -> tuple[Step, list[Memory]]:
    """One data rank's pipeline (a kind per stage): its step and each stage's memory."""
    tp, pp, m = layout.tp, layout.pp, layout.microbatches
    d = layout.dp_size(devices.world)
    tokens = rows / m * spec.seq  # per micro-batch
    recomputed = layout.recomputed(spec.layers)
    stage_time, memories, states = [], [], []
    for s, kind in enumerate(chain):
        blocks = split.blocks[s]
        weights = _stage_params(spec, tp, s, pp, blocks, layout.ep)
        flops = tokens * blocks * spec.block_time_flops(recomputed) / tp
        if s == pp - 1:
            flops += tokens * spec.rest_flops / tp
        traffic = 2 * tokens * (blocks * spec.block_activation_bytes + spec.rest_activation_bytes)
        compute = (
            flops / (kind.peak("bf16") * _efficiency(kind, spec, tp)) + traffic / tp / kind.hbm
        )
        collectives = (4 + 2 * recomputed) * blocks
        tensor = collectives * _ring(kind, tokens * spec.hidden * 2, tp, 1, all_reduce=True)
        tensor += blocks * _all_to_all_s(spec, layout, devices, kind, tokens)
        stage_time.append((compute, tensor))
        states.append(weights)
        memories.append(_memory(spec, layout, d, s, blocks, weights, tokens))
    slots = m + pp - 1  # 1F1B: the slowest stage's time per micro-batch, m + pp - 1 times
    compute = max(c for c, _ in stage_time) * slots
    tensor = max(t for _, t in stage_time) * slots
    send = tokens * spec.hidden * 2 / tp
    cross = devices.per_node < layout.tp * d * 2  # the next stage's ranks on another node
    pipeline = 0.0
    if pp > 1:
        k = chain[0]
        link, step = (k.inter, k.inter_step_s) if cross else (k.intra, k.intra_step_s)
        pipeline = 2 * slots * (COLLECTIVE_S + step + send / link)
    data = max(
        _data_exposed(spec, layout, devices, kind, states[s], split.blocks[s], stage_time[s][0])
        for s, kind in enumerate(chain)
    )
    optimizer = max(
        STEP_TRAFFIC * w / (d if layout.dp in ("zero1", "fsdp") else 1) / k.hbm
        for w, k in zip(states, chain)
    )
    return Step(compute, tensor, pipeline, data, optimizer), memories


def _data_exposed(
    spec: ModelSpec,
    layout: Layout,
    devices: DeviceSet,
    kind: DeviceKind,
    weights: float,
    blocks: int,
    per_microbatch: float,
) -> float:
    """Data parallelism's seconds that compute does not hide, on one stage."""
    d, tp = layout.dp_size(devices.world), layout.tp
    if d == 1:
        return 0.0
    nodes = max(1, math.ceil(d * tp / devices.per_node)) if d * tp > devices.per_node else 1
    backward = per_microbatch * 2 / 3  # backward is two of a micro-batch's three passes
    if layout.dp != "fsdp":
        # the gradients' all-reduce (zero1: reduce-scatter + all-gather, the same bytes), in
        # buckets behind the last micro-batch's backward; the last bucket is never hidden
        total = _ring(kind, weights * GRAD_BYTES, d, nodes, all_reduce=True)
        last = _ring(kind, min(weights * GRAD_BYTES, 25e6), d, nodes, all_reduce=True)
        return max(total - backward, last)
    # FSDP, per unit (each block; the embedding and head as one more): all-gathers behind the
    # previous unit's forward (and backward), reduce-scatters behind the next one's backward;
    # an FSDP pipeline stage gathers once (first micro-batch) and reduces once (the last)
    units = blocks + 1
    unit = weights / units * WEIGHT_BYTES
    gather = _ring(kind, unit, d, nodes)
    forward_unit, backward_unit = per_microbatch / 3 / units, backward / units
    exposed = gather  # the first unit's gather waits for nothing to hide behind
    exposed += (units - 1) * max(0.0, gather - forward_unit)
    again = 1 if layout.pp > 1 else 2  # a stage does not reshard between micro-batches
    exposed += units * max(0.0, (again - 1) * gather + gather - backward_unit)
    return exposed


def _memory(
    spec: ModelSpec,
    layout: Layout,
    d: int,
    stage: int,
    blocks: int,
    weights: float,
    tokens: float,
) -> Memory:
    tp, pp, m = layout.tp, layout.pp, layout.microbatches
    # zero1 and fsdp shard the experts over their replicas only (d / ep ranks hold each one):
    # as if the rank's experts were ep times larger, sharded over all d
    sharded = weights + blocks * spec.block_expert_params / layout.ep / tp * (layout.ep - 1)
    if layout.dp == "replicate":
        w, g, o, buffers = (
            weights * WEIGHT_BYTES,
            weights * GRAD_BYTES,
            weights * OPTIMIZER_BYTES,
            0.0,
        )
    elif layout.dp == "zero1":
        w, g, o, buffers = (
            weights * WEIGHT_BYTES,
            weights * GRAD_BYTES,
            sharded * OPTIMIZER_BYTES / d,
            0.0,
        )
    else:
        w, g, o = (
            sharded * WEIGHT_BYTES / d,
            sharded * GRAD_BYTES / d,
            sharded * OPTIMIZER_BYTES / d,
        )
        if pp > 1:  # the stage stays gathered, its gradients whole until the last micro-batch
            buffers = weights * (WEIGHT_BYTES + GRAD_BYTES)
        else:  # one unit gathered, one prefetched, a unit's gradients and their reduce input
            buffers = 4 * spec.block_params * WEIGHT_BYTES / tp
    r = layout.recomputed(spec.layers)
    per_block = (1 - r) * spec.block_activation_bytes + r * spec.block_input_bytes
    in_flight = min(pp, m) if stage == 0 else max(1, min(pp - stage, m))
    activations = in_flight * blocks * tokens * per_block / tp
    if r:  # a recomputed block's own activations, live again while its backward runs
        activations += tokens * spec.block_activation_bytes / tp
    if stage == pp - 1:  # the head's logits and loss, for the micro-batch in backward
        activations += tokens * spec.rest_activation_bytes / tp
    return Memory(w, g, o, buffers, activations)


def _all_to_all_s(
    spec: ModelSpec, layout: Layout, devices: DeviceSet, kind: DeviceKind, tokens: float
) -> float:
    """One MoE block's expert-parallel routing per micro-batch: 4 all-to-alls (tokens to their
    experts and back, forward and backward) of tokens x top_k x hidden bf16 values, of which
    (ep - 1) / ep leave the rank, one message per peer (an expert group is consecutive data
    ranks: within a node while tp x ep fits one)."""
    ep = layout.ep
    if ep == 1 or not spec.experts:
        return 0.0
    cross = layout.tp * ep > devices.per_node
    link, step = (kind.inter, kind.inter_step_s) if cross else (kind.intra, kind.intra_step_s)
    out = routed_bytes(tokens * max(spec.top_k, 1), spec.hidden, 2) * (ep - 1) / ep  # bf16
    return 4 * (COLLECTIVE_S + (ep - 1) * step + out / link)


def _stage_params(spec: ModelSpec, tp: int, stage: int, pp: int, blocks: int, ep: int = 1) -> float:
    """Parameters on one rank of ``stage``: its blocks (the plan's layers / tp, the experts
    / (tp x ep): the plan cuts each expert inside, transformers' moe_tp_experts, and ep deals
    them), the embedding on the first stage and the head on the last (vocabulary-split / tp).
    (``block_sharded_params`` counts the plan's 2-D layers, not the 3-D experts.)"""
    sharded, experts = spec.block_sharded_params, spec.block_expert_params
    per_block = sharded / tp + (spec.block_params - sharded - experts) + experts / (tp * ep)
    rest = spec.params - spec.layers * spec.block_params - spec.embed_params - spec.head_params
    out = blocks * per_block
    if stage == 0:
        out += spec.embed_params / tp
    if stage == pp - 1:
        out += (spec.head_params / tp) + rest
    return out


def _ring(kind: DeviceKind, nbytes: float, n: int, nodes: int, all_reduce: bool = False) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` over ``n`` ranks on ``nodes`` nodes
    (an all-reduce: twice): NCCL's fixed latency, a latency per step, the bytes at the slowest
    link crossed."""
    if n <= 1:
        return 0.0
    steps = n - 1
    inter = nodes - 1 if nodes > 1 else 0
    bandwidth = kind.inter if nodes > 1 else kind.intra
    once = (
        COLLECTIVE_S
        + (steps - inter) * kind.intra_step_s
        + inter * kind.inter_step_s
        + nbytes * steps / n / bandwidth
    )
    return 2 * once if all_reduce else once


def _efficiency(kind: DeviceKind, spec: ModelSpec, tp: int) -> float:
    """Of the peak, what the block's matrix multiplies reach when tp narrows them."""
    width = spec.hidden / tp
    return kind.matmul_efficiency * width / (width + NARROW)


def _speed(kind: DeviceKind, tp: int, spec: ModelSpec) -> float:
    return kind.peak("bf16") * _efficiency(kind, spec, tp)


def _stage_kinds(layout: Layout, devices: DeviceSet) -> list[list[DeviceKind]]:
    """[stage][data rank] -> the device kind that rank's tensor group runs at (its slowest)."""
    d, tp = layout.dp_size(devices.world), layout.tp
    if devices.uniform:
        return [[devices.groups[0][1]] * d for _ in range(layout.pp)]
    bounds, start = [], 0
    for n, k in devices.groups:
        bounds.append((start, start + n, k))
        start += n
    out = []
    for s in range(layout.pp):
        row = []
        for j in range(d):
            first = (s * d + j) * tp
            group = [k for lo, hi, k in bounds if lo < first + tp and first < hi]
            row.append(min(group, key=lambda k: (k.peak("bf16"), k.memory)))
        out.append(row)
    return out


def _blocks_even(layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def _proportional(total: int, weights: list[float], minimum: int = 0) -> list[int]:
    """``total`` split in whole parts proportional to ``weights`` (largest remainders)."""
    n = len(weights)
    if total < minimum * n:
        return [total // n + (1 if i < total % n else 0) for i in range(n)]
    free = total - minimum * n
    scale = sum(weights)
    exact = [free * w / scale for w in weights]
    parts = [minimum + math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts
