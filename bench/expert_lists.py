"""Expert parallelism over experts in an ``nn.ModuleList`` (the block's forward run twice, the
experts once) vs the same mixture with stacked experts under ep=2 and vs data parallel alone,
2 gloo ranks.

    python bench/expert_lists.py [--hidden 256] [--experts 8] [--rows 8] [--seq 64] [--steps 12]

``tests.expert_models``' hand-written MoE (2 blocks, top-2, float32): ``ListMoE`` (experts in
``nn.ModuleList``s, looped over in the block's forward) and ``PlainMoE`` (the same shapes,
experts stacked ``(experts, ...)`` and called as ``experts(hidden, index, weights)``). Each
rank trains on its half of the global batch, AdamW: ``ListMoE`` under ep=2 and under data
parallel alone (every rank all experts, DDP's layout), ``PlainMoE`` under ep=2. Steps alternate
between the three in one run (the same machine load), each after a barrier; the figures are
median step times on rank 0's clock and their ratios, wall and rank 0's process CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SOURCE = """
import macrogen as mg


def ep(model):
    return mg.parallelize(model, ep=2)


def dp(model):
    return mg.parallelize(model)
"""


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> dict:
    import torch.distributed as dist

    from macrogen.runtime import mesh
    from tests.expert_models import ListMoE, PlainMoE
    from tests.helpers import expand, load_module

    module = load_module(expand(SOURCE), f"bench_expert_lists_{rank}", Path(tmp))
    sizes = dict(vocab=1024, hidden=args.hidden, experts=args.experts)
    torch.manual_seed(0)
    runs = {"list ep=2": module.ep(ListMoE(**sizes))}
    mesh.reset()  # (one mesh per program: each model keeps the groups it was given)
    torch.manual_seed(0)
    runs["stacked ep=2"] = module.ep(PlainMoE(**sizes))
    mesh.reset()
    torch.manual_seed(0)
    runs["list, data parallel"] = module.dp(ListMoE(**sizes))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in runs.items()}
    half = args.rows // world
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1024, (args.rows, args.seq), generator=gen)[rank * half :][:half]
               for _ in range(args.steps + 1)]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for i, ids in enumerate(batches):
        for name, model in runs.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            model(ids, ids).backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            if i:  # the first step plans buckets and warms up
                times[name].append(time.perf_counter() - start)
                cpus[name].append(time.process_time() - cpu)
    return {
        "median s": {name: statistics.median(t) for name, t in times.items()},
        "cpu s": {name: statistics.median(t) for name, t in cpus.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_worker, 2, args=(args, tmp), timeout=1800)
    r0 = results[0]
    print(f"hand-written MoE, hidden {args.hidden}, {args.experts} experts, top-2, 2 blocks,"
          f" {args.rows} x {args.seq} tokens per step, float32, 2 gloo ranks")  # fmt: skip
    wall, cpu = r0["median s"], r0["cpu s"]
    for name, seconds in wall.items():
        print(f"  {name:22s} {seconds * 1e3:8.1f} ms/step, CPU {cpu[name] * 1e3:8.1f} ms")
    for peer in ("stacked ep=2", "list, data parallel"):
        print(f"list ep=2 / {peer}: {wall['list ep=2'] / wall[peer]:.2f}"
              f" (CPU {cpu['list ep=2'] / cpu[peer]:.2f})")  # fmt: skip
    print("load average:", " ".join(f"{x:.2f}" for x in __import__("os").getloadavg()))


if __name__ == "__main__":
    main()
