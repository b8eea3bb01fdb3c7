"""Local SGD over a slow link: outer SGD (DiLoCo) with and without overlapped synchronization.

    python bench/local_sgd.py [--latency-ms 50] [--steps 8] [--rounds 5] [--sync-every 1 4]
                              [--n-embd 128] [--n-layer 2] [--batch 4]
    python bench/local_sgd.py --losses [--loss-steps 300]

Two gloo ranks on this machine train the GPT of examples/gpt.py with AdamW.
A slow link is simulated by giving every all-reduce ``--latency-ms`` of extra
latency: a blocking call returns that much later; an asynchronous one
(``async_op=True``) completes no earlier than that long after it started, so
the time can be hidden behind computation, as on a real link. For each
``sync_every`` k the variants take turns in the same two processes, ``--steps``
steps each per round, and the median time per step is printed with its ratio
to the non-overlapped form measured in the same run:

    compute        sync_every=10**9: no synchronization at all (the floor)
    outer          outer=outer_sgd(lr=0.7, momentum=0.9, nesterov=True)
    overlap        ... overlap=True, delay=1 (the all-reduce runs during the next step)
    overlap_d0     ... overlap=True, delay=0 (started and waited for at once: as outer)

With compute time C per step and latency L, outer costs C + L/k per step and
overlap C + max(0, L - C)/k: the best ratio is max(C, L) / (C + L) at k = 1.

``--losses`` trains a small GPT on this repository's docs for k = 1, 8, 32
with plain averaging, outer Nesterov and overlapped outer Nesterov, and prints
the loss averaged over the last 20 steps (docs/async.md quotes it).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)  # --n-embd, --n-layer
LOSS_MODEL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)
NEVER = 10**9  # sync_every for the no-communication floor

SOURCE = """
import macrogen as mg
from examples.gpt import GPT

{classes}
"""
CLASS = """
@mg.data_parallel({args})
class {name}(GPT):
    pass
"""
OUTER = "outer=mg.outer_sgd(lr=0.7, momentum=0.9, nesterov=True)"


def variants(ks: list[int]) -> dict[str, str]:
    """Class name -> the @data_parallel arguments."""
    out = {"compute": f"sync_every={NEVER}"}
    for k in ks:
        out[f"outer_k{k}"] = f"sync_every={k}, {OUTER}"
        out[f"overlap_k{k}"] = f"sync_every={k}, {OUTER}, overlap=True, delay=1"
        out[f"overlap_d0_k{k}"] = f"sync_every={k}, {OUTER}, overlap=True, delay=0"
    return out


def expanded(out_dir: Path, classes: dict[str, str], module: str):
    from macrogen.expand import expand_source

    text = SOURCE.format(classes="".join(CLASS.format(name=n, args=a) for n, a in classes.items()))
    (out_dir / f"{module}.py").write_text(expand_source(text, path="bench/local_sgd.py").code)
    sys.path.insert(0, str(out_dir))
    return __import__(module)


class SlowLink:
    """Every all-reduce takes ``latency`` seconds more; an asynchronous one overlaps it."""

    def __init__(self, latency: float):
        self.latency = latency
        self.waited = 0.0  # seconds spent waiting for all-reduces (blocking or asynchronous)
        self._orig = dist.all_reduce

    def __enter__(self) -> SlowLink:
        def slow(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            work = self._orig(*args, **kwargs)
            if kwargs.get("async_op"):
                return _Late(self, work, start + self.latency)
            time.sleep(max(0.0, start + self.latency - time.perf_counter()))
            self.waited += time.perf_counter() - start
            return work

        dist.all_reduce = slow
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._orig


class _Late:
    """An asynchronous all-reduce that is done no earlier than ``ready``."""

    def __init__(self, link: SlowLink, work: Any, ready: float):
        self.link, self.work, self.ready = link, work, ready

    def wait(self) -> bool:
        start = time.perf_counter()
        time.sleep(max(0.0, self.ready - start))
        done = self.work.wait()
        self.link.waited += time.perf_counter() - start
        return done


def setup(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    setup(rank, world, port)
    from examples.gpt import GPTConfig, batch

    classes = variants(args.sync_every)
    models = expanded(Path(out_dir), classes, "bench_local_sgd_models")
    config = GPTConfig(**{**MODEL, "n_embd": args.n_embd, "n_layer": args.n_layer})
    x, y = batch(config, args.batch, seed=rank)
    runs = {}
    for name in classes:
        torch.manual_seed(0)
        model = getattr(models, name)(config)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times: dict[str, list[float]] = {n: [] for n in runs}
    waits: dict[str, list[float]] = {n: [] for n in runs}
    cpu: dict[str, list[float]] = {n: [] for n in runs}
    with SlowLink(args.latency_ms / 1000) as link:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, (model, opt) in runs.items():
                dist.barrier()
                waited = link.waited
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    opt.zero_grad()
                    model(x, y).backward()
                    opt.step()
                if r:
                    times[name].append((time.perf_counter() - start) / args.steps)
                    waits[name].append((link.waited - waited) / args.steps)
                    cpu[name].append((time.process_time() - cpu_start) / args.steps)
    if rank == 0:
        report(times, waits, cpu, args)
    dist.barrier()
    dist.destroy_process_group()


def report(
    times: dict[str, list[float]],
    waits: dict[str, list[float]],
    cpu: dict[str, list[float]],
    args: argparse.Namespace,
) -> None:
    ms = {n: 1000 * statistics.median(t) for n, t in times.items()}
    wait = {n: 1000 * statistics.median(t) for n, t in waits.items()}
    cpu_ms = {n: 1000 * statistics.median(t) for n, t in cpu.items()}
    c = ms["compute"]
    model = {**MODEL, "n_embd": args.n_embd, "n_layer": args.n_layer}
    print(f"2 gloo ranks, GPT {model}, batch {args.batch}/rank, AdamW; injected all-reduce latency"
          f" {args.latency_ms:g} ms; median of {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print(f"compute only (no synchronization): {c:7.1f} ms/step")
    print("ms per step (of which waiting for the network); ratio: overlap d=1 / outer; ideal:")
    print("(C + max(0, L - C)/k) / (C + L/k) for compute C and latency L")
    print(
        f"{'sync_every':>10}  {'outer':>14}  {'overlap d=1':>14}  {'ratio':>5}  {'d=0':>14}  {'ideal':>5}"
    )
    for k in args.sync_every:
        names = (f"outer_k{k}", f"overlap_k{k}", f"overlap_d0_k{k}")
        outer, over, d0 = (f"{ms[n]:6.1f} ({wait[n]:5.1f})" for n in names)
        lat = args.latency_ms
        ideal = (c + max(0.0, lat - c) / k) / (c + lat / k)
        ratio = ms[names[1]] / ms[names[0]]
        print(f"{k:>10}  {outer:>14}  {over:>14}  {ratio:5.2f}  {d0:>14}  {ideal:5.2f}")
    print("rank 0's CPU time per step (all threads), ms: "
          + ", ".join(f"{n} {v:.1f}" for n, v in cpu_ms.items()))  # fmt: skip


# -- what each variant costs in loss ------------------------------------------------------
def corpus() -> torch.Tensor:
    """Bytes of this repository's docs: text a byte-level GPT can learn from."""
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def loss_classes() -> dict[str, str]:
    out = {}
    for k in (1, 8, 32):
        out[f"plain_k{k}"] = f"sync_every={k}"
        out[f"outer_k{k}"] = f"sync_every={k}, {OUTER}"
        out[f"overlap_k{k}"] = f"sync_every={k}, {OUTER}, overlap=True, delay=1"
    return out


def loss_worker(
    rank: int, world: int, port: int, steps: int, out_dir: str, png: str | None = None
) -> None:
    setup(rank, world, port)
    from examples.gpt import GPTConfig
    from macrogen.runtime.data_parallel import flush

    classes = loss_classes()
    models = expanded(Path(out_dir), classes, "bench_local_sgd_loss_models")
    config = GPTConfig(**LOSS_MODEL)
    data = corpus()
    T, B = config.block_size, 8
    final: dict[str, float] = {}
    curves: dict[str, list[float]] = {}
    for name in classes:
        torch.manual_seed(0)
        model = getattr(models, name)(config)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        every = []
        for _ in range(steps):
            starts = torch.randint(0, len(data) - T - 1, (B,), generator=g)
            window = torch.stack([data[s : s + T + 1] for s in starts])
            opt.zero_grad()
            loss = model(window[:, :-1], window[:, 1:])
            loss.backward()
            opt.step()
            every.append(loss.detach())
        flush(model)
        mean = torch.stack(every)
        dist.all_reduce(mean)  # each step's loss, summed over the ranks
        curves[name] = (mean / world).tolist()
        final[name] = float(mean[-20:].mean()) / world
    if rank == 0:
        print(f"GPT {LOSS_MODEL}, 2 gloo ranks x {B} sequences, AdamW lr 3e-3, {steps} steps;"
              " training loss, mean of the last 20 steps and both ranks")  # fmt: skip
        print(f"{'sync_every':>10}  {'plain':>7}  {'outer':>7}  {'overlap':>7}")
        for k in (1, 8, 32):
            row = [final[f"{v}_k{k}"] for v in ("plain", "outer", "overlap")]
            print(f"{k:>10}  " + "  ".join(f"{v:7.3f}" for v in row))
        if png is not None:
            plot(curves, png, steps)
    dist.barrier()
    dist.destroy_process_group()


def plot(curves: dict[str, list[float]], png: str, steps: int) -> None:
    """One panel per k: plain averaging, the outer Nesterov step, and it overlapped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=110, sharey=True)
    labels = {"plain": "plain averaging", "outer": "outer Nesterov (DiLoCo)",
              "overlap": "outer Nesterov, overlapped (delay 1)"}  # fmt: skip
    for ax, k in zip(axes, (1, 8, 32)):
        for variant, label in labels.items():
            ys = torch.tensor(curves[f"{variant}_k{k}"])
            smooth = ys.unfold(0, 10, 1).mean(1)  # 10-step moving average
            ax.plot(range(10, len(ys) + 1), smooth.tolist(), label=label)
        ax.set_title(f"sync_every={k}" + (" (k=1 plain: synchronous)" if k == 1 else ""))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (2 ranks, 10-step average)")
    axes[0].legend()
    fig.suptitle(
        f"Local SGD on examples/gpt.py (2 layers, d=64, 2 gloo ranks, AdamW, {steps} steps)"
    )
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=8, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sync-every", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"])
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"])
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences per rank (compute ~ latency)"
    )
    parser.add_argument("--losses", action="store_true", help="final losses instead of times")
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--png", help="with --losses: draw the loss curves here (matplotlib)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        if args.losses:
            png = str(Path(args.png).resolve()) if args.png else None
            mp.spawn(loss_worker, args=(2, port, args.loss_steps, tmp, png), nprocs=2)
        else:
            mp.spawn(worker, args=(2, port, args, tmp), nprocs=2)


if __name__ == "__main__":
    main()
