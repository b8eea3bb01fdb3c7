"""fused_allreduce against K separate all_reduce calls: 2 gloo ranks (CPU), and NCCL with --cuda.

    python bench/fused_allreduce.py [--k 16] [--rounds 15] [--iters 20] [--cuda]

The annotated block is expanded with ``macrogen expand``'s own function; both
versions run in the same processes, alternating round by round so that load on
the machine hits both alike. A round is ``torch.utils.benchmark.Timer.timeit``
of ``--iters`` calls (a fixed count: every rank must issue the same
collectives); the figure is the median round on rank 0. Cases:

- ``small``: K float32 tensors of 1..1023 elements;
- ``mixed``: K tensors of float32, bfloat16 and int64, ragged sizes;
- ``large``: K float32 tensors of 64K elements (CPU) or 1M (CUDA).

Goals (issue 10): fused / separate <= 0.15 for small tensors, and never above
1.0 for any mix of dtypes. ``--cuda`` (only where CUDA exists) runs the same
cases in one process, world size 1 on NCCL, and also prints the host time of
one fused block (calls issued without waiting for the GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.benchmark import Timer

from macrogen.expand import expand_source

CASES = ("small", "mixed", "large")


def block_source(k: int) -> str:
    params = ", ".join(f"t{i}" for i in range(k))
    calls = "".join(f"        dist.all_reduce(t{i})\n" for i in range(k))
    return (
        "import torch.distributed as dist\n\nimport macrogen as mg\n\n\n"
        f"def sync({params}):\n    with mg.fused_allreduce():\n{calls}"
    )


def tensors(case: str, k: int, device: str) -> list[torch.Tensor]:
    """The same shapes and dtypes on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 1024, (k,), generator=gen)]
    if case == "large":
        sizes = [(2**20 if device == "cuda" else 2**16)] * k
    dtypes = [torch.float32] * k
    if case == "mixed":
        dtypes = [(torch.float32, torch.bfloat16, torch.int64)[i % 3] for i in range(k)]
    return [torch.zeros(n, dtype=d, device=device) for n, d in zip(sizes, dtypes)]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def measure(serial, fused, ts, rounds: int, iters: int, barrier) -> dict[str, float]:
    """Median seconds per block of each version, alternating rounds."""
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for fn in (serial, fused):  # warm-up: plans, buffers, communicators
        fn(*ts)
    for _ in range(rounds):
        for name, fn in (("separate", serial), ("fused", fused)):
            barrier()
            timer = Timer("fn(*ts)", globals={"fn": fn, "ts": ts})
            times[name].append(timer.timeit(iters).mean)
    return {name: statistics.median(v) for name, v in times.items()}


def _rank(rank: int, world: int, port: int, directory: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    serial = _load(Path(directory) / "serial.py", "bench_serial").sync
    fused = _load(Path(directory) / "expanded.py", "bench_expanded").sync
    results = {}
    for case in CASES:
        ts = tensors(case, args.k, "cpu")
        results[case] = measure(serial, fused, ts, args.rounds, args.iters, dist.barrier)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(title: str, results: dict[str, dict[str, float]], k: int) -> None:
    print(title)
    print(f"  {'case':<8} {'separate us':>12} {'fused us':>10} {'fused/separate':>15}")
    for case, m in results.items():
        ratio = m["fused"] / m["separate"]
        print(f"  {case:<8} {m['separate'] * 1e6:12.1f} {m['fused'] * 1e6:10.1f} {ratio:15.3f}")
    print("  goals: small <= 0.15; every case <= 1.0")


def cpu_section(args, directory: str) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, directory, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    report(
        f"K={args.k}, 2 gloo ranks (CPU), median of {args.rounds} rounds x {args.iters}",
        results,
        args.k,
    )


def cuda_section(args, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    serial = _load(Path(directory) / "serial.py", "bench_serial_cuda").sync
    fused = _load(Path(directory) / "expanded.py", "bench_expanded_cuda").sync
    results, host = {}, {}
    for case in CASES:
        ts = tensors(case, args.k, "cuda")
        results[case] = measure(serial, fused, ts, args.rounds, args.iters, torch.cuda.synchronize)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            fused(*ts)
        host[case] = (time.perf_counter() - start) / args.iters  # issued, not waited for
        torch.cuda.synchronize()
    report(f"K={args.k}, NCCL world size 1 on {torch.cuda.get_device_name()}", results, args.k)
    print("  host time of one fused block: "
          + ", ".join(f"{c} {t * 1e6:.1f} us" for c, t in host.items()))  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--cuda", action="store_true", help="also NCCL on this machine's GPU")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda needs a GPU; this machine has none")

    with tempfile.TemporaryDirectory() as directory:
        source = block_source(args.k)
        (Path(directory) / "serial.py").write_text(source)
        (Path(directory) / "expanded.py").write_text(expand_source(source, path="serial.py").code)
        cpu_section(args, directory)
        if args.cuda:
            cuda_section(args, directory)


if __name__ == "__main__":
    main()
