"""Step time of a layout: compute from a serial probe, collectives on an alpha-beta network.

Pure functions. Per step, on one rank (D = data ways, m = micro-batches):

- compute: the serial step / D, the planned layers' share / tp, the blocks'
  share / pp, times the pipeline's bubble (m + pp - 1) / m (1F1B);
- tensor parallel: Megatron's 4 all-reduces per block (2 forward, 2 backward)
  of one block's output for the rank's micro-batch, over tp ranks (sequence
  parallel's reduce-scatter + all-gather moves the same bytes);
- data parallel: replicate and zero1 all-reduce the rank's gradients once
  (a ring moves 2x the parameter bytes); fsdp all-gathers them twice and
  reduce-scatters once (3x), one collective per unit (each block, and the root);
- pipeline: each micro-batch's activations forward and gradient back across a cut.

A collective over n ranks costs ring steps x (alpha + bytes per step / beta)
on the slowest link its group crosses: tensor groups are contiguous ranks
(one node while tp <= ranks per node), data and pipeline groups are strided.
Nothing overlaps (gloo on CPU blocks the computing thread); ``fit`` scales the
compute and the communication terms to measured step times.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from macrogen.autotune.layouts import Layout
from macrogen.autotune.memory import Profile, pp_share, tp_share


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes per second
    latency: float = 5e-6  # seconds per message (alpha)


@dataclass(frozen=True)
class Machine:
    per_node: int  # ranks sharing the fast link
    intra: Link
    inter: Link
    slowdown: float = 1.0  # compute: ranks over cores on a shared CPU


# gloo on one host (loopback TCP), from bench/collectives.py on the development machine
GLOO_LOCAL = Link("gloo", bandwidth=0.7e9, latency=3.7e-4)


_LINK = re.compile(r"\s*([A-Za-z][\w-]*)\s*:\s*([\d.eE+]+)\s*([KMGT]?)(B|b)/s\s*")


def parse_links(text: str) -> tuple[Link, Link]:
    """``nvlink:900GB/s,ib:50GB/s`` -> (within a node, across nodes); one link: both."""
    scale = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    links = []
    for part in text.split(","):
        m = _LINK.fullmatch(part)
        if m is None:
            raise ValueError(
                f"--link {part.strip()!r}: expected NAME:BANDWIDTH such as nvlink:900GB/s"
            )
        bandwidth = float(m.group(2)) * scale[m.group(3)] / (8 if m.group(4) == "b" else 1)
        if bandwidth <= 0:
            raise ValueError(f"--link {part.strip()!r}: the bandwidth must be positive")
        links.append(Link(m.group(1), bandwidth))
    if len(links) > 2:
        raise ValueError(f"--link {text!r}: at most two links (within a node, across nodes)")
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


def send_s(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class Step:
    compute: float
    tensor: float
    data: float
    pipeline: float

    @property
    def communication(self) -> float:
        return self.tensor + self.data + self.pipeline

    @property
    def total(self) -> float:
        return self.compute + self.communication


def predict(profile: Profile, layout: Layout, world: int, machine: Machine) -> Step:
    d, tp, pp, m = layout.dp_size(world), layout.tp, layout.pp, layout.microbatches
    bubble = (m + pp - 1) / m
    block = profile.block_s / profile.step_s if profile.step_s else 0.0
    compute = (
        profile.step_s
        / d
        * tp_share(profile, tp)
        * (block / pp + (1 - block))
        * bubble
        * machine.slowdown
    )
    tp_link = machine.intra if tp <= machine.per_node else machine.inter
    # a stage's d x tp ranks are consecutive: its data groups stay in a node when they fit
    dp_link = machine.intra if tp * d <= machine.per_node else machine.inter
    pp_link = machine.intra if world <= machine.per_node else machine.inter
    message = profile.message_bytes / d / m  # one block's output, one micro-batch of this rank
    blocks = profile.blocks / pp if profile.blocks else 0.0
    tensor = 4 * blocks * m * all_reduce_s(message, tp, tp_link)
    grads = profile.param_bytes * tp_share(profile, tp) * pp_share(profile, pp)
    if layout.dp == "fsdp":  # per unit (each block, then the root): 2 all-gathers, 1 reduce-scatter
        units = (profile.blocks / pp if profile.blocks else 0.0) + 1
        data = 3 * (all_gather_s(grads, d, dp_link) + (units - 1) * (d - 1) * dp_link.latency)
    else:
        data = all_reduce_s(grads, d, dp_link)
    pipeline = 2 * m * send_s(message / tp, pp_link) if pp > 1 else 0.0
    return Step(compute, tensor, data, pipeline)


@dataclass(frozen=True)
class Fit:
    """Scales of the compute and communication terms, fitted to measured step times."""

    compute: float = 1.0
    communication: float = 1.0

    def __call__(self, step: Step) -> float:
        return self.compute * step.compute + self.communication * step.communication


def fit(points: Sequence[tuple[Step, float]]) -> Fit:
    """Least squares of measured = a x compute + b x communication (a, b >= 0).

    One point (or terms that do not separate) fits one common scale.
    """
    if not points:
        return Fit()
    common = sum(t for _, t in points) / max(sum(s.total for s, _ in points), 1e-12)
    if len(points) < 2:
        return Fit(common, common)
    cc = sum(s.compute**2 for s, _ in points)
    nn = sum(s.communication**2 for s, _ in points)
    cn = sum(s.compute * s.communication for s, _ in points)
    ct = sum(s.compute * t for s, t in points)
    nt = sum(s.communication * t for s, t in points)
    det = cc * nn - cn * cn
    if det <= 1e-12 * max(cc * nn, 1e-30):
        return Fit(common, common)
    a = (ct * nn - nt * cn) / det
    b = (cc * nt - cn * ct) / det
    if a <= 0 or b < 0:  # a negative scale explains noise, not the machine
        a = ct / cc if cc else common
        return Fit(a, 0.0) if b < 0 else Fit(common, common)
    return Fit(a, b)
