"""Peak memory per rank of a layout, predicted from one serial probe of the model.

Pure functions over a ``Profile`` (what ``probe.py`` measures on one process,
or what a test writes down). Bytes are tensor bytes above those live before the
model was built (``process_memory.TensorPeak``), what the autotune worker
measures on each rank:

    params   P x tp share x pipeline share          (fsdp: / D, + two blocks' buffers;
                                                     under pp: whole through the step, + / D;
                                                     its gradients + / D + one block's)
    state    S x the same shares                    (zero1 and fsdp: / D)
    grads    as the parameters                      (fsdp: / D + two blocks' buffers)
    and the larger of the step's two transients:
    activations  A / D (the global batch is split over the data ranks)
                 x activations' tp share x (1/pp) x in-flight micro-batches / micro-batches
                 (recompute every N-th block, a share r of the blocks: their share of A
                 x (1 - r), plus one block's, live again while it is recomputed, plus each
                 recomputed block's input, the residual stream, whole under tp)
                 (zero1 with D > 1, and replicate with D > 1 under pp or ep: + a copy of
                 the gradients; replicate without either takes each gradient into its
                 bucket as autograd makes it, and frees it)
                 (- the gradients, when the layout does not hold them at the activations'
                 peak: see below)
    optimizer    T, the optimizer step's temporaries, x the parameters' shares (zero1, fsdp: / D)
    data         the entry's own tensors between steps (its batch): whole on every rank

With ``ep``, a rank holds 1/ep of the experts' parameters, gradients and optimizer state (an
expert group of ep ranks deals them out); zero1 and fsdp shard those over the d/ep ranks that
hold the same experts, 1/d of them per rank as without ep, and an FSDP unit gathers 1/ep of its
experts.

The peak is the larger of a step's and the build's: ``mg.parallelize`` takes a
built model, so every rank holds the whole serial model while it cuts its
shards (P, plus the shards made before the whole is freed). A model built on the
meta device (``init=``) has no build term: each rank allocates only its shards
and holds one layer whole beside them, less than a step's peak.

S is the optimizer's state (the probe counts the tensors of the optimizer over
the model); A the activations: the larger of what the model's forward adds and
what the step adds outside the optimizer step above the parameters, the state and
the gradients it keeps (``probe.py``); T the optimizer step's own
peak above its start. The activations peak at the forward's end, where the
gradients exist only if the layout holds them: the data-parallel buckets (replicate,
zero1 with D > 1) keep them between steps, a pipeline's micro-batches accumulate
into them, recompute moves the peak into backward where most are made, and a step
that zeroes without freeing keeps them; otherwise (one data rank, FSDP's shards)
the freed gradients are taken off the activations. The
tensor-parallel share of the parameters is f/tp + (1 - f), f the fraction of
them in planned (sharded) layers; of the activations the same with f the share
of the bytes autograd saves that the plan cuts (the MLP's hidden side, the
attention heads: the residual stream stays whole); a pipeline stage holds
1/pp of the blocks and, conservatively, all the rest (embeddings, head). Under
1F1B the first stage holds min(pp, microbatches) micro-batches' activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from macrogen.autotune.layouts import Layout


@dataclass(frozen=True)
class Profile:
    """The model, measured once on one process (serial, the whole global batch)."""

    param_bytes: int  # every parameter
    sharded_bytes: int  # of those, in the tensor-parallel plan's sharded layers
    block_bytes: int  # of those, in the repeated blocks
    blocks: int  # the repeated blocks (0: none found)
    state_bytes: int  # the optimizer's state
    transient_bytes: int  # gradients + activations: a step's peak above parameters + state
    step_s: float = 0.0  # one serial step
    step_one_thread_s: float = 0.0  # the same at one intra-op thread (0: not measured)
    block_s: float = 0.0  # of it, the blocks' forward + backward
    # one block's forward + backward at any batch (Python, dispatch, launches): per micro-batch
    block_call_s: float = 0.0
    # what recomputing a block adds to that per call (None: not measured; a forward's share)
    recompute_call_s: float | None = None
    optimizer_s: float = 0.0  # of the step, the optimizer's (0: not measured)
    data_bytes: int = 0  # what the entry holds beside the model between steps (its batch)
    message_bytes: int = 0  # one block's output for the whole batch (what TP all-reduces)
    optimizer_bytes: int = 0  # the optimizer step's temporaries, above the gradients
    activation_sharded: float | None = None  # activations' share tp shards (None: as parameters)
    # activations' share made in the blocks (None: as parameters)
    block_activations: float | None = None
    # a mixture of experts (probe_experts): the experts' parameters (in the blocks' bytes), its
    # MoE layers, the experts' forward + backward in the step and of it their fixed cost per
    # step (E experts a layer, E / ep under ep), the bytes routed one way per step (the batch's
    # (token, slot) pairs x hidden x element size)
    expert_bytes: int = 0
    expert_layers: int = 0
    expert_s: float = 0.0
    expert_call_s: float = 0.0
    routed_bytes: int = 0
    # the entry's step keeps its gradients through the forward (zero_grad(set_to_none=False))
    grads_kept: bool = False

    @property
    def sharded_fraction(self) -> float:
        return self.sharded_bytes / self.param_bytes if self.param_bytes else 0.0

    @property
    def block_fraction(self) -> float:
        return self.block_bytes / self.param_bytes if self.param_bytes else 0.0

    @property
    def activation_bytes(self) -> int:
        return max(0, self.transient_bytes - self.param_bytes)


def with_batch(profile: Profile, factor: float) -> Profile:
    """The profile at ``factor`` x the probe's global batch (``macrogen plan --global-batch``):
    activations, the batch, a block's output and the step's time per row grow with it; the
    parameters, the optimizer's state and step, and the blocks' fixed cost per call do not."""
    fixed = profile.blocks * profile.block_call_s

    def grow(seconds: float, kept: float) -> float:
        kept = min(kept, seconds)
        return kept + (seconds - kept) * factor

    step_s = grow(profile.step_s, fixed + profile.optimizer_s)
    ratio = step_s / profile.step_s if profile.step_s else factor
    return replace(
        profile,
        transient_bytes=profile.param_bytes + round(profile.activation_bytes * factor),
        data_bytes=round(profile.data_bytes * factor),
        message_bytes=round(profile.message_bytes * factor),
        routed_bytes=round(profile.routed_bytes * factor),
        expert_s=grow(profile.expert_s, profile.expert_call_s),
        step_s=step_s,
        step_one_thread_s=profile.step_one_thread_s * ratio,  # its fixed parts: as the step's
        block_s=grow(profile.block_s, fixed),
    )


def dealt_bytes(profile: Profile, ep: int) -> float:
    """The experts' bytes a rank does not hold under ``ep``: an expert group of ep ranks deals
    them out (the tp plan's cut inside them is not counted: the probe's plan sizes are 2-D)."""
    return profile.expert_bytes * (1 - 1 / ep)


def tp_share(profile: Profile, tp: int) -> float:
    f = profile.sharded_fraction
    return f / tp + (1 - f)


def activation_tp_share(profile: Profile, tp: int) -> float:
    f = profile.activation_sharded
    if f is None:
        return tp_share(profile, tp)
    return f / tp + (1 - f)


def pp_share(profile: Profile, pp: int) -> float:
    f = profile.block_fraction
    return f / pp + (1 - f)


@dataclass(frozen=True)
class Breakdown:
    params: float
    state: float
    grads: float
    activations: float  # forward and backward's own tensors, or the optimizer step's
    build: float = 0.0  # while the serial model is cut into this rank's shards
    data: float = 0.0  # the entry's own tensors (its batch), whole on every rank
    buffers: float = 0.0  # a pipeline stage's receive buffers, every micro-batch's

    @property
    def step(self) -> float:
        return self.params + self.state + self.grads + self.activations + self.data + self.buffers

    @property
    def total(self) -> float:
        return max(self.step, self.build)


def predict(profile: Profile, layout: Layout, world: int, *, meta: bool = False) -> Breakdown:
    """Predicted peak bytes on the busiest rank (the first pipeline stage); ``meta``: the model
    is built on the meta device and each rank materializes its shards (no build term)."""
    d = layout.dp_size(world)
    share = tp_share(profile, layout.tp) * pp_share(profile, layout.pp)
    whole = profile.param_bytes * share  # this rank's parameters before dp and ep deal them
    # ep: the experts the other ranks of the expert group hold (a share of every parameter's
    # bytes, state and temporaries alike); zero1 and fsdp shard the rank's experts over their
    # d / ep replicas, so that what they shard per rank is the whole's over d, as without ep
    dealt = dealt_bytes(profile, layout.ep) / profile.param_bytes if profile.param_bytes else 0.0
    params = profile.param_bytes * (share - dealt)
    state = profile.state_bytes * (share - dealt)
    temporaries = profile.optimizer_bytes * (share - dealt)  # the optimizer step's foreach buffers
    dealt *= profile.param_bytes
    one_block = (
        (profile.block_bytes - dealt) / profile.blocks * tp_share(profile, layout.tp)
        if profile.blocks
        else 0.0
    )
    grads = params
    if layout.dp in ("zero1", "fsdp"):
        state = profile.state_bytes * share / d
        temporaries = profile.optimizer_bytes * share / d
    if layout.dp == "fsdp" and layout.pp > 1:
        # torch's pipeline schedule keeps an FSDP stage gathered through each backward and
        # reduces its gradients once, after the last micro-batch: the stage holds both whole
        # beside the shards, and one unit's reduce-scatter input at a time
        params += params / d
        grads += grads / d + one_block
    elif layout.dp == "fsdp":
        # FSDP2 at the step's peak (backward's start): the unit gathered and the next one
        # prefetched, the unit's full gradients and the reduce-scatter's input. Four units:
        # the measured layouts held 0.2 to 5.8 above the rest over four runs, median 3.1
        # (seven, every buffer at once, was 3% to 29% over; docs/autotune.md)
        params = (params + dealt) / d + 2 * one_block
        grads = (grads + dealt) / d + 2 * one_block
    in_flight = min(layout.pp, layout.microbatches) / layout.microbatches
    kept, inputs = float(profile.activation_bytes), 0.0
    if layout.recompute and profile.blocks:
        # a recomputed block keeps its input (the residual stream: whole under tp), the others
        # all their activations; in backward a recomputed block's own activations live again,
        # above the forward's peak only when no kept block above it was freed first: when the
        # first stage's last block is recomputed (all are, or every N-th with N dividing its index)
        f = profile.block_activations
        in_blocks = kept * (profile.block_fraction if f is None else f)
        r = layout.recomputed(profile.blocks)
        last = math.ceil(profile.blocks / layout.pp) - 1  # the first stage's last block
        again = last % layout.recompute == 0
        kept += (in_blocks / profile.blocks if again else 0.0) - in_blocks * r
        inputs = float(profile.message_bytes * profile.blocks) * r
    share = activation_tp_share(profile, layout.tp)
    activations = (kept * share + inputs) / d / layout.pp * in_flight
    if not _gradients_at_peak(profile, layout, d):
        # the activations peak at the forward's end: the gradients freed at the step's start
        # are not made yet (the data-parallel buckets and FSDP's gathers are counted apart)
        freed = whole / d if layout.dp == "fsdp" else whole - dealt
        activations = max(0.0, activations - freed)
    staged = layout.pp > 1 or layout.ep > 1
    if d > 1 and (layout.dp == "zero1" or (layout.dp == "replicate" and staged)):
        # the gradients twice: zero1 keeps the local ones beside the reduce-scattered shares; a
        # replicated stage's micro-batches accumulate into autograd's own tensors, which the
        # buckets take only after the last (ep: its experts' are flattened for their replicas'
        # all-reduce; not measured apart). Without either the buckets take each gradient as
        # autograd makes it and free it: no copy (measured on 2 and 4 ranks, docs/autotune.md)
        activations += grads
    sharded = layout.tp > 1 or layout.pp > 1 or layout.dp == "fsdp" or layout.ep > 1
    build = 0.0 if meta else profile.param_bytes + (params if sharded else 0.0)
    # torch's pipeline stage allocates a receive buffer for every micro-batch up front and
    # keeps them: the first stage's for the gradients (the last's for the activations)
    buffers = profile.message_bytes / d if layout.pp > 1 else 0.0
    activations = max(activations, temporaries)
    return Breakdown(params, state, grads, activations, build, profile.data_bytes, buffers)


def _gradients_at_peak(profile: Profile, layout: Layout, d: int) -> bool:
    """The layout's gradients are live when its activations peak: the step keeps them
    (``zero_grad(set_to_none=False)``), the data-parallel buckets hold them between steps,
    a pipeline's micro-batches accumulate into them, or recompute moves the peak into
    backward, where most of them are made."""
    buckets = d > 1 and layout.dp in ("replicate", "zero1")
    return profile.grads_kept or buckets or layout.pp > 1 or layout.recompute > 0


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
