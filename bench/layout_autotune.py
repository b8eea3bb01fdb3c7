"""Layout autotuning against an exhaustive sweep, and the models' honesty, on gloo ranks.

    python bench/layout_autotune.py [--world-sizes 2,4] [--runs 3] [--model unseen|example]
                                    [--dim 128] [--busy N] [--plot FILE] [--json FILE]

The model (default ``unseen``: 8 blocks of causal attention and a SwiGLU MLP with RMS
norms, written here and in none of the project's tests or examples; ``example``:
examples/layout_auto.py's MLP blocks), with ``layout="auto"``, is tuned on gloo ranks
(CPU; NCCL when CUDA is present) once exhaustively (every feasible layout measured;
its five fastest then timed in four turns side by side, each keeping the median of its
five runs, the best the one faster than each other in most turns) and ``--runs`` times as
``macrogen autotune`` searches (the cost model's best first, early stopping, the
leaders timed side by side in turns until one is faster than each other in more turns
than chance gives), each search from an empty database. It prints, per layout, the measured
step time and peak memory per rank beside the predictions:

- raw: the cost model as the probe and bench/collectives.py's link make it;
- fitted: the compute and communication scales and the fixed costs of an FSDP
  unit and of a collective call, fitted to every measured layout of the world
  size, as the search fits its own runs;
- held out: the same fit without the layout itself (what the model predicts of
  a layout it has not measured);
- memory: the model alone (no fitted constant);

then, per world size, whether the fitted model orders the three fastest as
measured, and for each search run its winner against the sweep's best and how many
layouts it measured, with the load average while it ran (the machine is shared); then
the sweep's best and each search's winner timed again side by side, ``--paired`` turns
each in one launch, compared turn by turn (on a loaded machine one run of a layout lands
20-400% from another: the sweep's single runs are no yardstick for 5%, runs taken back to
back in the same turns are).
``--busy N`` runs N other jobs beside the searches and the side-by-side timing (each a
process of torch matmuls on one thread, unpinned, as another training job on the machine):
the sweep, the reference, runs without them, and the winners are compared with its best side
by side under the same load. ``--plot`` draws measured and predicted step time per layout
(matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.console import Console

from macrogen.autotune import cost, database, finals, layout_search, memory
from macrogen.autotune.measure import Measurement, Program, Timing, measure
from macrogen.autotune.report import Reporter
from macrogen.autotune.tuner import autotune

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layout_auto.py"
KEY = "build.parallelize.layout"
TIE = 0.05  # measured step times this close are not ordered by one run each
SWEEP_FINALISTS, SWEEP_RUNS = 5, 5  # the sweep's fastest, each timed 5 times in turns

# A model the project has not seen: causal attention (heads divided by tp) and SwiGLU.
UNSEEN = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

DIM, HIDDEN, HEADS, BLOCKS, BATCH, SEQ = {dim}, {hidden}, 4, 8, 16, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_head, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(DIM)
        self.attn = Attention()
        self.norm2 = nn.RMSNorm(DIM)
        self.mlp = SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


PLAN = mg.define({{
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.attn.n_head": "divide",
    "layers.*.mlp.gate": "colwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
}})


def build():
    run = mg.launch()
    model = mg.parallelize(Net().to(run.device), layout="auto", tp_plan=PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = mg.mesh()
    share = BATCH // mesh.data_size
    data = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(BATCH, SEQ, DIM, generator=data).to(run.device),
        torch.randn(BATCH, SEQ, DIM, generator=data).to(run.device),
    )
    rows = slice(mesh.data_rank * share, (mesh.data_rank + 1) * share)

    def step():
        opt.zero_grad()
        mg.pipeline_step(model, x[rows], y[rows], F.mse_loss)
        opt.step()

    return model, step, {{"tokens": BATCH * SEQ}}
"""


# another training job on the machine: matmuls of a 512-wide layer on one thread, unpinned
OTHER_JOB = """\
import torch
torch.set_num_threads(1)
w, x = torch.randn(512, 512), torch.randn(256, 512)
while True:
    x = torch.tanh(x @ w)
"""


@contextlib.contextmanager
def busy(jobs: int) -> Iterator[None]:
    """``jobs`` other jobs running while the block runs (none: nothing started)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", OTHER_JOB], env=env, stdin=subprocess.DEVNULL)
        for _ in range(jobs)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def source(model: str, dim: int) -> str:
    if model == "unseen":
        return UNSEEN.format(dim=dim, hidden=8 * dim // 3 // 16 * 16)  # SwiGLU's 8/3, by 16
    return EXAMPLE.read_text().replace(
        "DIM, HIDDEN, BLOCKS, BATCH, SEQ = 64, 256,",
        f"DIM, HIDDEN, BLOCKS, BATCH, SEQ = {dim}, {4 * dim},",
    )


def tune(src: Path, world: int, db: Path, exhaustive: bool, timing: Timing):
    reporter = Reporter(Console(file=io.StringIO(), width=200), Console(file=io.StringIO()))
    # the sweep's SWEEP_FINALISTS fastest are timed again side by side, as the search's
    # leaders are: the measured order of the top three is then a median's, not one run's
    saved = (finals.FINALISTS, finals.CLOSE, finals.MIN_RUNS, finals.MAX_RUNS)
    if exhaustive:
        finals.FINALISTS, finals.CLOSE = SWEEP_FINALISTS, math.inf
        finals.MIN_RUNS = finals.MAX_RUNS = SWEEP_RUNS
    try:
        return autotune(
            src,
            entry=":build",
            world_size=world,
            tuning=db,
            timing=timing,
            reporter=reporter,
            noise=-math.inf if exhaustive else 0.05,
        )
    finally:
        finals.FINALISTS, finals.CLOSE, finals.MIN_RUNS, finals.MAX_RUNS = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--model", choices=("unseen", "example"), default="unseen")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="searches per world size")
    p.add_argument(
        "--paired", type=int, default=5, help="turns of the sweep's best beside each winner"
    )
    p.add_argument(
        "--busy", type=int, default=0, help="other jobs beside the searches and side-by-side"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--plot")
    p.add_argument("--json", help="write the measured and predicted rows here")
    args = p.parse_args()
    timing = Timing(warmup=2, steps=args.steps, rounds=args.rounds, timeout=120)
    rows = []  # (world, prediction, measured candidate)
    searches = []  # (world, run, winner, its sweep candidate, sweep best, measured, all, load)
    leaders = []  # (world, run, the search's leaders: timed again side by side)
    paired = []  # (world, [sweep's best, winners...], their runs side by side)
    plot_rows: list = []  # (name, measured, fitted) per layout, for --plot
    profiles = {}  # world size -> the probe's profile the predictions were made from
    with tempfile.TemporaryDirectory(prefix="layout-bench-") as tmp:
        src = Path(tmp) / "layout_bench.py"
        src.write_text(source(args.model, args.dim))
        for world in [int(w) for w in args.world_sizes.split(",")]:
            full = tune(src, world, Path(tmp) / f"x{world}.json", True, timing)
            preds = full.predictions or {}
            measured = {
                database.canonical(database.decode_values(c["values"])): c
                for c in full.record["candidates"]
                if "time_s" in c
            }
            profiles[world] = full.record.get("layout_probe", {}).get("profile")
            for ident, pred in preds.items():
                if ident in measured:
                    rows.append((world, pred, measured[ident]))
            # the sweep's best: its finals' winner (its five fastest, four turns side by side)
            top = measured[database.canonical(full.winner or {})]
            best = top["time_s"]
            print(f"{world} rank(s): sweep measured {len(measured)} layouts", flush=True)
            with busy(args.busy):  # the searches and the side-by-side timing, loaded alike
                searched = search_runs(src, world, args.runs, timing, measured, best, args.busy)
                for run, (found, found_winner, n_found, load) in enumerate(searched):
                    in_sweep = measured.get(database.canonical(found_winner or {}))
                    searches.append(
                        (world, run, found_winner, in_sweep, best, n_found, len(measured), load)
                    )
                    leaders.append(
                        (world, run, [c for c in found.record["candidates"] if "times" in c])
                    )
                # the sweep's best and each search's winner timed again side by side, in turns:
                # one run of a layout here is 20-400% from another, so the sweep's single runs
                # (all but its five fastest) are no yardstick for 5%
                chosen = [database.decode_values(top["values"])]
                for _, _, found_winner, *_ in [x for x in searches if x[0] == world]:
                    if found_winner and found_winner not in chosen:
                        chosen.append(found_winner)
                if len(chosen) > 1:
                    before = os.getloadavg()[0]
                    runs = side_by_side(src, world, chosen, timing, args.paired)
                    paired.append((world, chosen, runs, (before, os.getloadavg()[0])))
            # reported as soon as the world size is done: a run stopped later keeps it
            plot_rows += report(
                *[[x for x in xs if x[0] == world] for xs in (rows, searches, paired, leaders)]
            )
    if args.json:
        import json

        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "world": w,
                        "layout": pred.layout.name(),
                        "time_s": c["time_s"],
                        "peak_bytes": c.get("peak_bytes"),
                        "step": pred.step.__dict__,
                        "memory": {**pred.memory.__dict__, "total": pred.memory.total},
                        "profile": profiles.get(w),
                    }
                    for w, pred, c in rows
                ],
                indent=1,
            )
        )
    if args.plot:
        plot(plot_rows, args.plot)


def search_runs(
    src: Path, world: int, runs: int, timing: Timing, measured: dict, best: float, jobs: int
) -> list:
    """``runs`` searches, each from an empty database: (outcome, winner, layouts measured, the
    load average at its start and end)."""
    out = []
    for run in range(runs):
        start = os.getloadavg()[0]
        found = tune(src, world, src.parent / f"s{world}-{run}.json", False, timing)
        load = (start, os.getloadavg()[0])
        winner = measured.get(database.canonical(found.winner or {}))
        n_found = sum(1 for c in found.record["candidates"] if "time_s" in c)
        out.append((found, found.winner, n_found, load))
        ratio = winner["time_s"] / best if winner else float("nan")
        print(
            f"{world} rank(s), search {run + 1}: winner x{ratio:.3f} of the sweep's best,"
            f" {n_found} of {len(measured)} measured, {jobs} other job(s), load average"
            f" {load[0]:.1f}-{load[1]:.1f}",
            flush=True,
        )
    return out


def report(rows: list, searches: list, paired: list, leaders: list) -> list:
    """What was measured and predicted, for the world sizes of ``rows``; the plot's rows."""
    worlds = sorted({w for w, _, _ in rows})
    fits = {w: cost.fit([(p.step, c["time_s"]) for x, p, c in rows if x == w]) for w in worlds}

    def ms(v: float | None) -> str:
        return "the link's prior" if v is None else f"{v * 1e3:.2f} ms"

    for w, f in fits.items():
        print(
            f"fit on {w} rank(s) (as the search fits its own runs): compute x{f.compute:.3f},"
            f" communication x{f.communication:.3f}, {ms(f.per_unit)} per FSDP unit,"
            f" {ms(f.per_call)} per other collective call"
        )
    print(
        f"{'ranks':>5}  {'layout':<50} {'measured':>10} {'raw':>10} {'fitted':>10} {'err':>6}"
        f" {'held out':>10} {'err':>6} {'peak (max rank)':>16} {'predicted':>10} {'err':>6}"
    )
    plot_rows = []
    for world, pred, c in sorted(rows, key=lambda r: (r[0], r[2]["time_s"])):
        t, f, h = c["time_s"], fits[world](pred.step), held_out(rows, world, pred)(pred.step)
        peak = max(c.get("peak_bytes") or [0])
        mem = pred.memory.total
        print(
            f"{world:>5}  {pred.layout.describe(world):<50} {t * 1e3:>8.1f}ms"
            f" {pred.step.total * 1e3:>8.1f}ms {f * 1e3:>8.1f}ms {f / t - 1:>+6.0%}"
            f" {h * 1e3:>8.1f}ms {h / t - 1:>+6.0%} {memory.format_bytes(peak):>16}"
            f" {memory.format_bytes(mem):>10} {mem / peak - 1 if peak else 0:>+6.0%}"
        )
        plot_rows.append((f"{world}: {pred.layout.describe(world)}", t, f))
    summarize(rows, fits)
    for world, run, choice, winner, best, n_found, n_all, load in searches:
        ratio = winner["time_s"] / best if winner else float("nan")
        shown = layout_search.layouts.parse(choice[KEY]).describe(world) if choice else "-"
        print(
            f"{world} rank(s), search {run + 1}: measured {n_found} of {n_all}; winner {shown}:"
            f" x{ratio:.3f} of the sweep's best (measured in the sweep); load average"
            f" {load[0]:.1f}-{load[1]:.1f}"
        )
    versus = {}  # (world, winner) -> x of the sweep's best, side by side
    for world, chosen, runs, load in paired:
        names = [layout_search.layouts.parse(c[KEY]).describe(world) for c in chosen]
        for c, name, r in zip(chosen[1:], names[1:], runs[1:]):
            # turn by turn (the k-th run of each was timed in turn k): the median of the ratios
            ratios = [a / b for a, b in zip(r, runs[0])]
            versus[world, database.canonical(c)] = x = statistics.median(ratios or [math.inf])
            print(
                f"{world} rank(s), side by side ({len(ratios)} turns, load average"
                f" {load[0]:.1f}-{load[1]:.1f}): winner {name} x{x:.3f} of the sweep's best"
                f" {names[0]} (the median of the turns' ratios; faster in"
                f" {sum(q < 1 for q in ratios)} of {len(ratios)}); runs"
                f" {' '.join(f'{t * 1e3:.0f}' for t in r)} vs"
                f" {' '.join(f'{t * 1e3:.0f}' for t in runs[0])} ms"
            )
    for world in sorted({x[0] for x in searches}):
        # a winner that is the sweep's best is x1.000; another is judged side by side
        mine = [x for x in searches if x[0] == world]
        near = [
            versus.get(
                (world, database.canonical(choice or {})),
                1.0 if won is not None and won["time_s"] == best else math.inf,
            )
            <= 1.05
            for _, _, choice, won, best, *_ in mine
        ]
        print(
            f"{world} rank(s): winner within 5% of the sweep's best in {sum(near)} of {len(near)}"
        )
    for world, run, timed in leaders:
        shown = "; ".join(
            f"{layout_search.layouts.parse(database.decode_values(c['values'])[KEY]).describe(world)}"
            f" {' '.join(f'{t * 1e3:.1f}' for t in c['times'])} ms (median {c['time_s'] * 1e3:.1f})"
            for c in sorted(timed, key=lambda c: c["time_s"])
        )
        print(f"{world} rank(s), search {run + 1}: leaders {shown or 'none'}")
    return plot_rows


def side_by_side(src: Path, world: int, chosen: list, timing: Timing, turns: int) -> list:
    """Each layout of ``chosen`` timed ``turns`` times, in turns (A B C, B C A, ...: none
    always first), in one launch."""
    timing = dataclasses.replace(timing, group=1)  # a layout at a time: each its own mesh
    program = Program(src, src.read_text(), ":build", True, world, "cpu", timing, layout=True)
    if torch.cuda.is_available():
        program = dataclasses.replace(program, target="cuda")
    runs: dict[str, list[float]] = {database.canonical(c): [] for c in chosen}

    def on_result(m: Measurement) -> bool:
        if m.time_s is not None:
            runs[database.canonical(m.values)].append(m.time_s)
        return True

    n = len(chosen)
    measure(program, [chosen[(k + i) % n] for k in range(turns) for i in range(n)], on_result)
    return [runs[database.canonical(c)] for c in chosen]


def held_out(rows: list, world: int, pred) -> cost.Fit:
    """The fit of the world size's other layouts: what the model predicts of one it has not seen."""
    return cost.fit([(p.step, c["time_s"]) for w, p, c in rows if w == world and p is not pred])


def summarize(rows: list, fits: dict) -> None:
    """How many predictions land within 25% (time: fitted per world size, and held out) and 20%
    (memory), and whether each world size's three fastest layouts come in the measured order."""
    fitted = [fits[w](p.step) / c["time_s"] - 1 for w, p, c in rows]
    held = [held_out(rows, w, p)(p.step) / c["time_s"] - 1 for w, p, c in rows]
    peaks = [(p.memory.total, max(c["peak_bytes"])) for _, p, c in rows if c.get("peak_bytes")]
    print(
        f"step time within 25%: {sum(abs(e) <= 0.25 for e in fitted)} of {len(fitted)} fitted,"
        f" {sum(abs(e) <= 0.25 for e in held)} of {len(held)} held out;"
        f" peak memory within 20%: {sum(abs(m / k - 1) <= 0.20 for m, k in peaks)} of {len(peaks)}"
    )
    for world in sorted(fits):
        mine = [(p, c) for w, p, c in rows if w == world]
        by_time = sorted(mine, key=lambda r: r[1]["time_s"])[:3]
        by_model = sorted(mine, key=lambda r: fits[world](r[0].step))[:3]
        names = [p.layout.describe(world) for p, _ in by_time]
        theirs = [p.layout.describe(world) for p, _ in by_model]
        # a tie: the model's k-th is measured within TIE of the measured k-th (run-to-run noise
        # here is larger than that: no model orders layouts the measurements cannot)
        tied = all(
            c["time_s"] <= b["time_s"] * (1 + TIE) for (_, c), (_, b) in zip(by_model, by_time)
        )
        verdict = (
            "kept"
            if names == theirs
            else f"kept up to measured ties (within {TIE:.0%}): the model's {theirs}"
            if tied
            else f"differs: the model's {theirs}"
        )
        print(f"{world} rank(s): measured top three {names}; the model's order {verdict}")


def plot(rows: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(max(9, 0.45 * len(rows)), 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] * 1e3 for r in rows], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r[2] * 1e3 for r in rows], 0.4, label="predicted (fitted)")
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("step time (ms)")
    where = f"{torch.cuda.get_device_name()} (NCCL)" if torch.cuda.is_available() else "gloo ranks"
    ax.set_title(f"the layout bench's model on {where}: measured vs predicted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
