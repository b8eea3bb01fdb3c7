"""Pipeline step time: @pipeline on 2 CPU ranks against the serial step and torch by hand.

    python bench/pipeline.py [--depth 16] [--width 256] [--batch 32] [--rounds 5]
                             [--timeline docs/pipeline_timeline.png]

A residual MLP too deep for one rank's time budget (``--depth`` blocks of
d -> 4d -> d on ``--batch`` x 16 tokens) trains with SGD:

- *serial*: one process, one thread, ``mg.pipeline_step`` on the whole model;
- *@pipeline*: 2 gloo ranks of one thread each, the runtime the generated class
  calls (``attach(model, PipelineConfig(...), forward_cut(...), mesh)``), cut in the middle
  of the blocks;
- *by hand*: the same 2 ranks, the same split, two stage modules written by hand
  and handed to torch's ``PipelineStage`` and schedule, as torch's docs do it.

Each figure is the median step time over ``--rounds`` rounds, variants taking
turns a step each so that load from other programs hits them alike. Ratios:
pipelined / serial (ideal: 1/stages plus the bubble, (stages - 1) /
(microbatches + stages - 1) of the pipelined step for GPipe) and @pipeline /
by hand. With ``--timeline``, one more GPipe step records when each stage
computes each micro-batch (``forward_one_chunk`` / ``backward_one_chunk``,
wall clock) and draws the timeline with matplotlib (a bench-only dependency).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from macrogen.runtime import mesh as meshes  # noqa: E402
from macrogen.runtime import pipeline as rp  # noqa: E402
from macrogen.runtime.pipeline_plan import forward_cut  # noqa: E402

TOKENS = 16  # per sequence


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Deep(nn.Module):
    def __init__(self, d: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# Deep.forward as the @pipeline expansion writes it: one function per statement
def _deep_0(self, x):
    h = self.inp(x)
    return h


def _deep_1(self, block, h):
    h = block(h)
    return h


def _deep_2(self, h):
    return self.head(h)


DEEP_FORWARD = rp.Forward(
    params=("x",),
    statements=(
        rp.Statement(_deep_0, 0, reads=("x",), writes=("h",), parts=("inp",), calls=("inp",)),
        rp.Statement(_deep_1, 1, reads=("h",), writes=("h",), loop="blocks"),
        rp.Statement(_deep_2, 2, reads=("h",), parts=("head",), calls=("head",)),
    ),
)


class HandStage(nn.Module):
    """What a torch user writes for one stage: the layers of that stage, in order."""

    def __init__(self, model: Deep, first: int, end: int, stage: int, stages: int):
        super().__init__()
        self.inp = model.inp if stage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[first:end])
        self.head = model.head if stage == stages - 1 else None

    def forward(self, h):
        if self.inp is not None:
            h = self.inp(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def batch(args):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, TOKENS, args.width, generator=g)
    return x, torch.randn(args.batch, TOKENS, args.width, generator=g)


def model(args) -> Deep:
    torch.manual_seed(0)
    return Deep(args.width, args.depth)


def timed(step) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds for one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    x, y = batch(args)
    cut = args.depth // 2
    steps = {}
    whole = model(args)
    wopt = torch.optim.SGD(whole.parameters(), lr=1e-3)

    def serial():  # rank 0 alone (rank 1 waits): the unexpanded step on the whole model
        if rank == 0:
            wopt.zero_grad()
            rp.pipeline_step(whole, x, y, F.mse_loss)
            wopt.step()

    steps["serial (rank 0)"] = serial
    for schedule in ("gpipe", "1f1b"):
        meshes.reset()
        m = model(args)
        config = rp.PipelineConfig(
            stages=2, microbatches=args.microbatches, schedule=schedule, split=(f"blocks.{cut}",)
        )
        rp.attach(m, config, forward_cut(m, 2, config.split, DEEP_FORWARD), meshes.mesh(pipeline=2))
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def ours(m=m, opt=opt):
            opt.zero_grad()
            rp.pipeline_step(m, x, y, F.mse_loss)
            opt.step()

        steps[f"@pipeline {schedule}"] = ours

        full = model(args)
        first, end = (0, cut) if rank == 0 else (cut, args.depth)
        hand = HandStage(full, first, end, rank, world)
        hopt = torch.optim.SGD(hand.parameters(), lr=1e-3)
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = kind(PipelineStage(hand, rank, world, torch.device("cpu")), args.microbatches,
                     loss_fn=F.mse_loss)  # fmt: skip

        def by_hand(sched=sched, hopt=hopt):
            hopt.zero_grad()
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            hopt.step()

        steps[f"by hand {schedule}"] = by_hand

    for step in steps.values():  # warm-up (shape inference, buffers)
        step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            dist.barrier()
            times[name].append(timed(step))
    medians = {
        name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
        for name, t in times.items()
    }

    spans = []
    if args.timeline:  # one more @pipeline GPipe step with each chunk's compute recorded
        meshes.reset()
        m = model(args)
        config = rp.PipelineConfig(
            stages=2, microbatches=4, schedule="gpipe", split=(f"blocks.{cut}",)
        )
        pipe = rp.attach(
            m, config, forward_cut(m, 2, config.split, DEEP_FORWARD), meshes.mesh(pipeline=2)
        )
        rp.pipeline_step(m, x, y, F.mse_loss)  # builds the stage and the schedule
        stage = pipe._schedule._stage
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            original = getattr(stage, method)

            def recorded(chunk, *a, _original=original, _kind=kind, **k):
                start = time.time()
                result = _original(chunk, *a, **k)
                spans.append((rank, _kind, chunk, start, time.time()))
                return result

            setattr(stage, method, recorded)
        dist.barrier()
        rp.pipeline_step(m, x, y, F.mse_loss)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (medians, spans))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def draw(spans, path: str, microbatches: int) -> float:
    """The timeline as a PNG; returns the seconds both stages computed at once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s[3] for s in spans)
    fig, ax = plt.subplots(figsize=(9, 2.4))
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for rank, kind, chunk, start, end in spans:
        ax.broken_barh([((start - t0) * 1e3, (end - start) * 1e3)], (rank - 0.4, 0.8),
                       facecolors=colors[kind], edgecolor="black", linewidth=0.5)  # fmt: skip
        ax.text((start + end - 2 * t0) / 2 * 1e3, rank, f"{kind}{chunk}", ha="center",
                va="center", fontsize=8, color="white")  # fmt: skip
    ax.set_yticks([0, 1], ["stage 0 (rank 0)", "stage 1 (rank 1)"])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first compute")
    ax.set_title(
        f"@pipeline, GPipe, {microbatches} micro-batches on 2 stages (F: forward, B: backward)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    busy = {r: [(s[3], s[4]) for s in spans if s[0] == r] for r in (0, 1)}
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in busy[0] for b0, b1 in busy[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeline", default="")
    args = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(ROOT / ".bench_pipeline.pt")
    mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
    gathered = torch.load(out, weights_only=False)
    os.unlink(out)
    wall = gathered[0][0]  # rank 0's clock: a pipelined step ends on both ranks together
    cpu = {n: max(g[0][n][1] for g in gathered) for n in wall}  # the busier rank's CPU time
    stages, m = 2, args.microbatches
    bubble = (stages - 1) / (m + stages - 1)
    print(f"model: {args.depth} blocks of d={args.width}, batch {args.batch} x {TOKENS} tokens,"
          f" {stages} stages, {m} micro-batches, 1 thread per rank, median of {args.rounds}")  # fmt: skip
    print(f"bubble fraction (stages-1)/(microbatches+stages-1) = {bubble:.3f};"
          f" ideal pipelined/serial = 1/{stages} / (1 - bubble) = {0.5 / (1 - bubble):.3f}")  # fmt: skip
    serial_wall, serial_cpu = wall["serial (rank 0)"][0], cpu["serial (rank 0)"]
    print(f"{'':<18} {'wall ms':>9} {'x serial':>9} {'x by hand':>10}"
          f" {'CPU ms (busier rank)':>21} {'x serial':>9}")  # fmt: skip
    for name, (w, _) in wall.items():
        hand = wall.get(name.replace("@pipeline", "by hand"), (w, 0))[0]
        by_hand = f"{w / hand:10.2f}" if name.startswith("@pipeline") else " " * 10
        print(f"{name:<18} {w * 1e3:9.1f} {w / serial_wall:9.2f} {by_hand}"
              f" {cpu[name] * 1e3:21.1f} {cpu[name] / serial_cpu:9.2f}")  # fmt: skip
    if args.timeline:
        spans = [s for _, rank_spans in gathered for s in rank_spans]
        overlap = draw(spans, args.timeline, 4)
        busy = sum(s[4] - s[3] for s in spans)
        print(f"timeline: {args.timeline}; the stages computed at once for {overlap * 1e3:.1f} ms"
              f" ({overlap / busy * 2:.0%} of the mean stage's busy time)")  # fmt: skip


if __name__ == "__main__":
    main()
