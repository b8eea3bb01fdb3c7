"""Link parameters (alpha, beta) of the actual backend, for the layout cost model.

    python bench/collectives.py --world-size 2 [--sizes 4KB,256KB,4MB,16MB] [--out links.json]

Times all_reduce and all_gather on ``--world-size`` ranks (gloo on CPU, NCCL on
CUDA) for each message size, and fits the alpha-beta model of
``macrogen/autotune/cost.py`` to them by least squares: a ring collective over n
ranks costs steps x (alpha + bytes / n / beta), steps = 2(n - 1) for all_reduce
and n - 1 for all_gather. Prints a table and the fitted link; ``--out`` writes
it as JSON (``{"bandwidth": bytes/s, "latency": s}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = "4KB,64KB,1MB,4MB,16MB"


def _bytes(text: str) -> int:
    from macrogen.autotune import units

    return int(units.size("--sizes", text))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    n = dist.get_world_size()
    rows = []
    for size in [_bytes(s) for s in args.sizes.split(",")]:
        x = torch.ones(size // 4, device=device)
        parts = [torch.empty(size // 4 // n, device=device) for _ in range(n)]
        for name, op, steps in (
            ("all_reduce", lambda x=x: dist.all_reduce(x), 2 * (n - 1)),
            ("all_gather", lambda parts=parts: dist.all_gather(parts, parts[0]), n - 1),
        ):
            times = []
            for i in range(args.repeat + 2):
                dist.barrier()
                start = time.perf_counter()
                op()
                if cuda:
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - start)
            rows.append((name, size, steps, statistics.median(times)))
    if dist.get_rank() == 0:
        print(json.dumps({"world": n, "rows": rows}))
    dist.destroy_process_group()


def fit(world: int, rows: list) -> tuple[float, float]:
    """alpha, beta from t = steps * alpha + steps * bytes / n / beta (least squares)."""
    xs = [(steps, steps * size / world) for _, size, steps, _ in rows]
    ts = [t for *_, t in rows]
    a11 = sum(x[0] * x[0] for x in xs)
    a12 = sum(x[0] * x[1] for x in xs)
    a22 = sum(x[1] * x[1] for x in xs)
    b1 = sum(x[0] * t for x, t in zip(xs, ts))
    b2 = sum(x[1] * t for x, t in zip(xs, ts))
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    inverse_beta = (a11 * b2 - a12 * b1) / det
    return max(alpha, 0.0), 1.0 / inverse_beta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank_main(args)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.world_size}",
        __file__,
        "--rank",
        f"--sizes={args.sizes}",
        f"--repeat={args.repeat}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    alpha, beta = fit(result["world"], result["rows"])
    print(f"{'collective':<11} {'bytes':>10} {'measured':>11} {'fitted':>11}")
    for name, size, steps, t in result["rows"]:
        model = steps * (alpha + size / result["world"] / beta)
        print(f"{name:<11} {size:>10} {t * 1e3:>9.3f}ms {model * 1e3:>9.3f}ms")
    print(f"link: latency {alpha * 1e6:.1f} us, bandwidth {beta / 1e9:.3f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": beta, "latency": alpha, "world": result["world"]}, f)


if __name__ == "__main__":
    main()
