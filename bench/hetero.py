"""A slow rank: uneven shares from measured speed (``dp_shares="measured"``) against the even split.

    python bench/hetero.py [--steps 40] [--batch 4096] [--width 256] [--layers 4]
                           [--rebalance-every 10] [--midrun-steps 70] [--busy-at 30]

Two gloo ranks, each pinned to a core of its own (``os.sched_setaffinity``); a busy
process (a Python spin loop) pinned to rank 1's core takes about half of it, so rank 1
computes about 2x slower. Every rank loads the same global batch of ``--batch`` rows and
``mg.shard(model, (x, y))`` hands it its rows. The model is an MLP trained with SGD.

Side by side (the busy process running all along): two models expanded from the same
file, ``mg.parallelize(model, dp="replicate", dp_shares="even")`` (the even split, as DDP
splits) and ``dp_shares="measured"``, take turns step by step in the same two
processes. Printed for each: the median step time, and for "measured" its ratio to the
even split and to the ideal, the global batch over the sum of the ranks' measured rates
(rows per second of forward and backward, the runtime's own measurement). The issue
asks for <= 0.75x the even split and within 10% of the ideal.

The prediction (``macrogen.runtime.shares.split_gain``: a step lasts as long as its slowest
rank, rows over rate, plus what every rank pays; the rule ``macrogen plan --devices``
predicts data ranks of different speeds with) is fed the even split's measured rates and
fixed cost per step (the step time beyond the slowest rank's compute: the all-reduce's
tail and the optimizer step), and its predicted gain is printed beside the measured one.

Mid-run: a fresh "measured" model without the busy process; rank 1 starts it at step
``--busy-at``; the rows per rank are printed for every step, and the step at which rank
1's share has moved halfway to where it settles.

``--pipeline``: the same two pinned ranks and busy process, a model of ``--blocks`` residual
MLP blocks cut into 2 pipeline stages (rank 1 holds stage 1), 1F1B over 4 micro-batches:
``mg.parallelize(model, pp=2, microbatches=4)`` (cut evenly by parameters) and
``pp_split="measured"`` (each rank's matmul probe before the cut: the slow rank's stage gets
fewer blocks), side by side; printed: each cut, the median step times and their ratio.

CPU-time figures (other jobs on this machine make wall times noisy): each rank's CPU
seconds per row and the share of its core it got (CPU time / wall time of its compute);
a rank's rate is its CPU rate times its core share, so the CPU figures say how much of a
difference was the busy process and how much the machine's other load.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"

SOURCE = """
import torch.nn as nn
import macrogen as mg


class MLP(nn.Module):
    def __init__(self, width, layers, classes=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return self.head(x)


def even(model):
    return mg.parallelize(model, dp="replicate", dp_shares="even")


def measured(model):
    return mg.parallelize(model, dp="replicate", dp_shares="measured",
                          dp_rebalance_every=REBALANCE_EVERY)
"""


PIPELINE_SOURCE = """
import torch.nn as nn
import torch.nn.functional as F
import macrogen as mg


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(x)))


class Deep(nn.Module):
    def __init__(self, width, blocks, classes=16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def even(model):
    return mg.parallelize(model, pp=2, microbatches=4, dp="none")


def measured(model):
    return mg.parallelize(model, pp=2, microbatches=4, dp="none", pp_split="measured")
"""


def expanded(out_dir: Path, text: str, name: str) -> Any:
    from macrogen.expand import expand_source

    (out_dir / f"{name}.py").write_text(expand_source(text, path="bench/hetero.py").code)
    sys.path.insert(0, str(out_dir))
    return __import__(name)


def start_busy(core: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BUSY, str(core)])


def stop_busy(busy: subprocess.Popen[bytes] | None) -> None:
    if busy is not None and busy.poll() is None:
        busy.kill()
        busy.wait()


class Run:
    """One model's steps on this rank: wall, compute (shard to end of backward), CPU, rows."""

    def __init__(self, module: Any, kind: str, args: argparse.Namespace):
        from macrogen.runtime.data_parallel import gradient_sync

        torch.manual_seed(0)
        self.model = getattr(module, kind)(module.MLP(args.width, args.layers))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        shares = gradient_sync(self.model).shares
        assert shares is not None
        self.shares = shares
        self.wall: list[float] = []
        self.compute: list[float] = []
        self.cpu: list[float] = []
        self.rows: list[list[int]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        import macrogen as mg

        seconds, start, cpu = self.shares.total_seconds, time.perf_counter(), time.process_time()
        xs, ys = mg.shard(self.model, (x, y))
        F.cross_entropy(self.model(xs), ys).backward()
        cpu_compute = time.process_time() - cpu  # (includes waiting threads' CPU: gloo's)
        self.opt.step()
        self.opt.zero_grad()
        self.wall.append(time.perf_counter() - start)
        self.compute.append(self.shares.total_seconds - seconds)
        self.cpu.append(cpu_compute)
        self.rows.append(list(self.shares.rows))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank]
    os.sched_setaffinity(0, {core})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.pipeline:
        pipeline_worker(rank, core, args, tmp)
        return
    text = SOURCE.replace("REBALANCE_EVERY", str(args.rebalance_every))
    module = expanded(Path(tmp), text, "bench_hetero_models") if rank == 0 else None
    dist.barrier()
    if module is None:
        module = expanded(Path(tmp), text, "bench_hetero_models")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 16, (args.batch,), generator=gen)
    busy = None
    try:
        if rank == 1:
            busy = start_busy(core)
        runs = {kind: Run(module, kind, args) for kind in ("even", "measured")}
        dist.barrier()
        for step in range(args.steps):
            order = ("even", "measured") if step % 2 == 0 else ("measured", "even")
            for kind in order:
                runs[kind].step(x, y)
        stop_busy(busy)
        busy = None
        dist.barrier()
        mid = Run(module, "measured", args)
        for step in range(args.midrun_steps):
            if rank == 1 and step == args.busy_at:
                busy = start_busy(core)
            mid.step(x, y)
    finally:
        stop_busy(busy)
    mine = {kind: vars_of(run) for kind, run in (*runs.items(), ("mid", mid))}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        report(every, args)
    dist.destroy_process_group()


def pipeline_worker(rank: int, core: int, args: argparse.Namespace, tmp: str) -> None:
    import macrogen as mg
    from macrogen.runtime import pipeline

    module = expanded(Path(tmp), PIPELINE_SOURCE, "bench_hetero_pipeline") if rank == 0 else None
    dist.barrier()
    if module is None:
        module = expanded(Path(tmp), PIPELINE_SOURCE, "bench_hetero_pipeline")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 16, (args.batch,), generator=gen)
    busy = start_busy(core) if rank == 1 else None
    walls: dict[str, list[float]] = {"even": [], "measured": []}
    try:
        time.sleep(0.5)  # (the busy process is spinning before the probe)
        models = {}
        for kind in walls:
            torch.manual_seed(0)
            models[kind] = getattr(module, kind)(module.Deep(args.width, args.blocks))
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
        for step in range(args.steps):
            order = ("even", "measured") if step % 2 == 0 else ("measured", "even")
            for kind in order:
                dist.barrier()
                start = time.perf_counter()
                mg.pipeline_step(models[kind], x, y, F.cross_entropy)
                opts[kind].step()
                opts[kind].zero_grad()
                dist.barrier()
                walls[kind].append(time.perf_counter() - start)
    finally:
        stop_busy(busy)
    if rank == 0:
        warm = min(5, args.steps // 2)
        even = statistics.median(walls["even"][warm:])
        measured = statistics.median(walls["measured"][warm:])
        for kind, t in (("even", even), ("measured", measured)):
            cut = pipeline.pipeline_of(models[kind])
            assert cut is not None
            print(f"{kind:<9} {t * 1e3:7.1f}ms  {cut.describe()}")
        print(f"measured / even cut: {measured / even:.3f}")
    dist.destroy_process_group()


def vars_of(run: Run) -> dict[str, Any]:
    return {"wall": run.wall, "compute": run.compute, "cpu": run.cpu, "rows": run.rows}


def report(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from macrogen.runtime.shares import split_gain, split_rows

    b, warm = args.batch, min(2 * args.rebalance_every, args.steps // 2)

    def steps(kind: str) -> list[float]:  # the step lasts as long as its slowest rank's
        walls = [r[kind]["wall"][warm:] for r in ranks]
        return [max(w) for w in zip(*walls)]

    def rates(kind: str) -> list[float]:
        out = []
        for r, run in enumerate(ranks):
            rows = sum(step[r] for step in run[kind]["rows"][warm:])
            out.append(rows / sum(run[kind]["compute"][warm:]))
        return out

    even, measured = statistics.median(steps("even")), statistics.median(steps("measured"))
    rate = rates("measured")
    ideal = b / sum(rate)
    print(f"global batch {b} rows, MLP {args.layers} x {args.width}, SGD; 2 gloo ranks pinned to"
          f" cores; a busy process on rank 1's core; medians of steps {warm}..{args.steps - 1}")  # fmt: skip
    print(f"{'split':<10} {'step':>9} {'rows (rank 0, 1)':>18} {'rates (rows/s)':>20}")
    for kind, t in (("even", even), ("measured", measured)):
        rows = ranks[0][kind]["rows"][-1]
        r = rates(kind)
        print(f"{kind:<10} {t * 1e3:7.1f}ms {str(rows):>18} {r[0]:9.0f} {r[1]:9.0f}")
    print(f"measured / even split: {measured / even:.3f}  (asked: <= 0.75)")
    print(f"measured / ideal ({ideal * 1e3:.1f} ms = {b} rows / the ranks' summed rates):"
          f" {measured / ideal:.3f}  (asked: within 10%)")  # fmt: skip
    # the plan's model, fed what the even split measured
    even_rates = rates("even")
    slowest = [max(r["even"]["compute"][i] for r in ranks) for i in range(warm, args.steps)]
    fixed = max(0.0, even - statistics.median(slowest))
    p_even, p_adapted = split_gain(even_rates, b, None, fixed)
    split = split_rows(b, even_rates, [None, None])
    predicted, got = p_even / p_adapted, even / measured
    print(f"prediction from the even split's rates {[round(r) for r in even_rates]} rows/s and"
          f" {fixed * 1e3:.1f} ms fixed per step: even {p_even * 1e3:.1f} ms, adapted"
          f" {p_adapted * 1e3:.1f} ms (rows {split})")  # fmt: skip
    print(f"speed-up over the even split: predicted {predicted:.3f}, measured {got:.3f},"
          f" prediction / measured {predicted / got:.3f}  (asked: within 15%)")  # fmt: skip
    for kind in ("even", "measured"):
        for r, run in enumerate(ranks):
            cpu = sum(run[kind]["cpu"][warm:])
            wall = sum(run[kind]["compute"][warm:])
            rows = sum(step[r] for step in run[kind]["rows"][warm:])
            print(f"CPU {kind:<9} rank {r}: {cpu / rows * 1e6:6.1f} CPU us/row,"
                  f" {cpu / wall:.2f} of its core while computing")  # fmt: skip
    # The CPU-time model: each rank's CPU cost per row (its own work, whatever else runs) on
    # a machine where rank 0 has its core and rank 1 shares its core with the busy process
    per_row = []
    for r, run in enumerate(ranks):
        rows = sum(step[r] for kind in ("even", "measured") for step in run[kind]["rows"][warm:])
        cpu = sum(sum(run[kind]["cpu"][warm:]) for kind in ("even", "measured"))
        per_row.append(cpu / rows)
    quiet = [1.0 / per_row[0], 0.5 / per_row[1]]
    q_even, q_adapted = split_gain(quiet, b, None, 0.0)
    print(f"CPU-time model (rank 0 a whole core, rank 1 half of one; {per_row[0] * 1e6:.1f} and"
          f" {per_row[1] * 1e6:.1f} CPU us/row): even {q_even * 1e3:.1f} ms, measured shares"
          f" {q_adapted * 1e3:.1f} ms, ratio {q_adapted / q_even:.3f} (compute only)")  # fmt: skip
    mid = [r["mid"] for r in ranks]
    print(f"\nmid-run: the busy process starts on rank 1's core at step {args.busy_at}")
    print(f"{'step':>4} {'rows 0':>6} {'rows 1':>6} {'step':>9}")
    shares = []
    for i in range(args.midrun_steps):
        rows = mid[0]["rows"][i]
        shares.append(rows[1] / b)
        wall = max(m["wall"][i] for m in mid)
        print(f"{i:4d} {rows[0]:6d} {rows[1]:6d} {wall * 1e3:7.1f}ms")
    before = shares[args.busy_at - 1]
    after = statistics.median(shares[-args.rebalance_every :])
    half = before - 0.5 * (before - after)
    moved = next((i for i in range(args.busy_at, len(shares)) if shares[i] <= half), None)
    print(f"rank 1's share: {before:.3f} before, {after:.3f} at the end;"
          + (f" halfway at step {moved}, {moved - args.busy_at} steps after the busy process"
             " started (asked: within 20)" if moved is not None and after < before
             else " it did not move"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rebalance-every", type=int, default=10)
    parser.add_argument("--midrun-steps", type=int, default=70)
    parser.add_argument("--busy-at", type=int, default=30)
    parser.add_argument("--pipeline", action="store_true", help="uneven pipeline stages instead")
    parser.add_argument("--blocks", type=int, default=8, help="with --pipeline: the model's")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench/hetero.py needs two cores (one per rank)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, port, args, tmp), nprocs=2)


if __name__ == "__main__":
    main()
