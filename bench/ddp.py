"""Data-parallel step time: @data_parallel against torch DDP and per-tensor all-reduce.

    python bench/ddp.py [--steps 1] [--rounds 30]

Two gloo ranks on this machine train the same GPT (examples/gpt.py: 6 layers,
d=256, 77 parameter tensors) with AdamW. Every variant lives in the same two
processes and the variants take turns, a step each by default, so that load
from other programs hits them alike. Prints the median step time of each and the
ratios against the peers, and the all-reduce calls per step. The CPU time
per step (rank 0's process, all threads) is printed too: on a shared 2-core
machine it is steadier than wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(n_layer=6, n_embd=256, n_head=8, vocab_size=1024, block_size=64)
BATCH = 2  # sequences per rank
BUCKET_MB = 25  # torch DDP's default bucket_cap_mb; both sides use it
TUNED_MB = 4  # a smaller bucket (a choice of examples/gpt.py's tunable): more overlap, for both

# The variants subclass the serial GPT; expansion makes each a data-parallel model.
DATA_PARALLEL_SOURCE = """
import macrogen as mg
from examples.gpt import GPT


@mg.data_parallel(bucket_mb={bucket_mb}, compress=None)
class GPTDataParallel(GPT):
    pass


@mg.data_parallel(bucket_mb={bucket_mb}, compress="bf16")
class GPTDataParallelBF16(GPT):
    pass


@mg.data_parallel(bucket_mb={tuned_mb}, compress=None)
class GPTDataParallelTuned(GPT):
    pass
"""


def expanded_module(out_dir: Path):
    from macrogen.expand import expand_source

    path = out_dir / "bench_ddp_models.py"
    source = DATA_PARALLEL_SOURCE.format(bucket_mb=BUCKET_MB, tuned_mb=TUNED_MB)
    path.write_text(expand_source(source, path="bench/ddp.py").code)
    sys.path.insert(0, str(out_dir))
    import bench_ddp_models

    return bench_ddp_models


class CountAllReduce:
    """Counts Python-level dist.all_reduce calls (DDP's reducer calls C++: counted from its buckets)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig


HOOK_CALLS = {"ddp_bf16": 0, "ddp_counted": 0}


def ddp_bf16_hook(state, bucket):
    """DDP's own bf16_compress_hook; registered under another name, because DDP refuses that
    name unless it sees CUDA and NCCL (the hook itself runs on gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    HOOK_CALLS["ddp_bf16"] += 1
    return default_hooks.bf16_compress_hook(state, bucket)


def counting_allreduce_hook(state, bucket):
    """DDP's allreduce_hook, counted: on an untimed twin of the timed DDP model (same buckets)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    HOOK_CALLS["ddp_counted"] += 1
    return default_hooks.allreduce_hook(state, bucket)


def variants(models) -> dict[str, tuple[torch.nn.Module, Callable[[], None] | None]]:
    """name -> (model, what to run after backward); every model starts from the same weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(**MODEL)

    def fresh(cls):
        torch.manual_seed(0)
        return cls(config)

    out: dict[str, tuple[torch.nn.Module, Callable[[], None] | None]] = {}
    out["macrogen"] = (fresh(models.GPTDataParallel), None)
    out["ddp"] = (DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB), None)
    per_tensor = fresh(GPT)

    def all_reduce_each() -> None:
        w = dist.get_world_size()
        for p in per_tensor.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(w)

    out["per_tensor"] = (per_tensor, all_reduce_each)
    out["macrogen_bf16"] = (fresh(models.GPTDataParallelBF16), None)
    ddp_bf16 = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    ddp_bf16.register_comm_hook(None, ddp_bf16_hook)
    out["ddp_bf16"] = (ddp_bf16, None)
    out[f"macrogen_{TUNED_MB}mb"] = (fresh(models.GPTDataParallelTuned), None)
    out[f"ddp_{TUNED_MB}mb"] = (DDP(fresh(GPT), bucket_cap_mb=TUNED_MB), None)
    return out


def ddp_calls_per_step(bucket_cap_mb: float, idx, targets) -> int:
    """All-reduce calls per step of DDP with these buckets (after DDP rebuilds them at step 2)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.gpt import GPT, GPTConfig

    twin = DDP(GPT(GPTConfig(**MODEL)), bucket_cap_mb=bucket_cap_mb)
    twin.register_comm_hook(None, counting_allreduce_hook)
    for _ in range(3):
        HOOK_CALLS["ddp_counted"] = 0
        twin(idx, targets).backward()
    return HOOK_CALLS["ddp_counted"]


def worker(rank: int, world: int, port: int, steps: int, rounds: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    models = expanded_module(Path(out_dir))
    from examples.gpt import GPTConfig, batch

    idx, targets = batch(GPTConfig(**MODEL), BATCH, seed=1 + rank)
    runs = variants(models)
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, (m, _) in runs.items()}
    times: dict[str, list[float]] = {n: [] for n in runs}
    cpu_times: dict[str, list[float]] = {n: [] for n in runs}
    calls: dict[str, int] = {}

    def step(name: str) -> None:
        model, after_backward = runs[name]
        optimizers[name].zero_grad()
        model(idx, targets).backward()
        if after_backward is not None:
            after_backward()
        optimizers[name].step()

    for name in runs:  # warm up, and count the collectives of one step
        step(name)
        with CountAllReduce() as count:
            step(name)
        calls[name] = count.calls
    calls["ddp"] = ddp_calls_per_step(BUCKET_MB, idx, targets)
    calls[f"ddp_{TUNED_MB}mb"] = ddp_calls_per_step(TUNED_MB, idx, targets)
    HOOK_CALLS["ddp_bf16"] = 0
    step("ddp_bf16")
    calls["ddp_bf16"] = HOOK_CALLS["ddp_bf16"]
    started = time.perf_counter()
    for _ in range(rounds):
        for name in runs:
            for _ in range(steps):
                dist.barrier()
                c, t = cpu_seconds(), time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t)
                cpu_times[name].append(cpu_seconds() - c)
    if rank == 0:
        report(times, cpu_times, calls, time.perf_counter() - started)
    dist.barrier()
    dist.destroy_process_group()


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the compute thread and gloo's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def report(
    times: dict[str, list[float]],
    cpu_times: dict[str, list[float]],
    calls: dict[str, int],
    seconds: float,
) -> None:
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    cpu = {n: statistics.median(t) * 1e3 for n, t in cpu_times.items()}
    n = len(next(iter(times.values())))
    print(f"GPT {MODEL}, batch {BATCH}x{MODEL['block_size']} tokens per rank, 2 gloo ranks, AdamW")
    print(
        f"{n} timed steps per variant, interleaved; {seconds:.0f} s; load average {os.getloadavg()}"
    )
    print(
        f"{'variant':<15} {'median ms/step':>15} {'CPU ms/step':>12} {'all-reduce calls/step':>22}"
    )
    for n in times:
        print(f"{n:<15} {med[n]:>15.1f} {cpu[n]:>12.1f} {calls[n]:>22}")
    print()
    for what, a, b, goal in (
        ("macrogen / torch DDP (same bucket size)", "macrogen", "ddp", 0.85),
        ("macrogen / per-tensor all-reduce", "macrogen", "per_tensor", 0.50),
        ("macrogen bf16 / DDP bf16_compress_hook", "macrogen_bf16", "ddp_bf16", 0.85),
    ):
        print(f"{what:<42} {med[a] / med[b]:.3f}  (goal <= {goal}; CPU time {cpu[a] / cpu[b]:.3f})")
    tuned = f"macrogen_{TUNED_MB}mb"
    print(f"\nwith {TUNED_MB} MiB buckets (more overlap) on both sides:")
    for what, b in ((f"macrogen / torch DDP, both {TUNED_MB} MiB", f"ddp_{TUNED_MB}mb"),
                    (f"macrogen {TUNED_MB} MiB / torch DDP default 25 MiB", "ddp"),
                    (f"macrogen {TUNED_MB} MiB / per-tensor all-reduce", "per_tensor")):  # fmt: skip
        print(f"{what:<42} {med[tuned] / med[b]:.3f}  (CPU time {cpu[tuned] / cpu[b]:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, port, args.steps, args.rounds, tmp), nprocs=2, join=True)


if __name__ == "__main__":
    main()
