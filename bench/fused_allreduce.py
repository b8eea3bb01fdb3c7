"""fused_allreduce against K separate all_reduce calls, on 2 gloo ranks (CPU).

    python bench/fused_allreduce.py [--k 16] [--rounds 30] [--iters 20]

The annotated block is expanded with ``macrogen expand``'s own function; both
versions run in the same processes, alternating round by round so that load
on the machine hits both alike. Each round: a barrier, ``--iters`` calls, a
barrier; the figure is the median round time per call on rank 0. Goal: the
expanded block takes <= 0.40 of the K separate calls for K=16 small tensors.
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

from macrogen.expand import expand_source


def block_source(k: int) -> str:
    params = ", ".join(f"t{i}" for i in range(k))
    calls = "".join(f"        dist.all_reduce(t{i})\n" for i in range(k))
    return (
        "import torch.distributed as dist\n\nimport macrogen as mg\n\n\n"
        f"def sync({params}):\n    with mg.fused_allreduce():\n{calls}"
    )


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, world: int, port: int, directory: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    serial = _load(Path(directory) / "serial.py", "bench_serial").sync
    fused = _load(Path(directory) / "expanded.py", "bench_expanded").sync
    gen = torch.Generator().manual_seed(0)  # same sizes on every rank
    sizes = [int(n) for n in torch.randint(1, 1024, (args.k,), generator=gen)]
    tensors = [torch.randn(n) for n in sizes]

    def round_time(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(*tensors)
        dist.barrier()
        return (time.perf_counter() - start) / args.iters

    for fn in (serial, fused):  # warm-up
        round_time(fn)
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for _ in range(args.rounds):
        times["separate"].append(round_time(serial))
        times["fused"].append(round_time(fused))
    if rank == 0:
        queue.put(({k: statistics.median(v) for k, v in times.items()}, sum(sizes)))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        source = block_source(args.k)
        (Path(directory) / "serial.py").write_text(source)
        (Path(directory) / "expanded.py").write_text(expand_source(source, path="serial.py").code)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_rank, args=(r, 2, port, directory, args, queue)) for r in range(2)
        ]
        for p in procs:
            p.start()
        medians, numel = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)

    separate, fused = medians["separate"], medians["fused"]
    print(f"K={args.k} float32 tensors, {numel} elements in all, 2 gloo ranks (CPU)")
    print(
        f"  {args.k} separate all_reduce: {separate * 1e6:9.1f} us per block (median of {args.rounds} rounds x {args.iters})"
    )
    print(f"  expanded fused block:   {fused * 1e6:9.1f} us per block")
    print(f"  fused / separate:       {fused / separate:9.3f}   (goal <= 0.40)")


if __name__ == "__main__":
    main()
