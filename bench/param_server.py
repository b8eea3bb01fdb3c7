"""A large embedding table: replicated data parallelism vs. parameter servers (docs/async.md).

    python bench/param_server.py [--rows 100000] [--dim 64] [--steps 30] [--workers 2]

A recommender-shaped model (an ``nn.Embedding`` of ``--rows`` x ``--dim`` float32,
a batch of 8 x 32 ids per worker, a small dense head) trained with SGD on this
machine's gloo ranks, in four set-ups, each in fresh processes:

    replicated   every worker holds the table; its dense gradient is all-reduced each step
    server s=0   1 server rank holds the table (plan style "server"), synchronous
    server s=2   the same, staleness 2 (Hogwild on the server)
    2 servers    2 server ranks, synchronous
    s=0 rpc      as "server s=0", over torch RPC (the opt-in transport) instead of the
                 default point-to-point tensors on the job's process group

Printed per set-up: the median time per step (after 3 warm-up steps) and the tensor
bytes one worker moves per step (replicated: the gradient it all-reduces; servers:
ids out, rows in, gradient rows out, counted by ``param_server.traffic``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

BATCH, LENGTH, WARMUP = 8, 32, 3


class Rec(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1)).squeeze(-1)


def worker(
    rank: int, world: int, port: int, servers: int, staleness: int, transport: str, args, queue
) -> None:
    import torch.distributed as dist

    from macrogen.runtime import param_server
    from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Rec(args.rows, args.dim)
    if servers:
        config = param_server.ServerConfig(servers, staleness, "sgd", 0.5, transport=transport)
        try:
            param_server.apply_param_server(
                model,
                [("emb", model.emb)],
                config,
                where="bench",
                data_parallel=DataParallelConfig(),
            )
        except SystemExit:
            return
    else:
        from macrogen.runtime.mesh import mesh

        sync = GradientSync(model, DataParallelConfig(), where="bench", mesh=mesh())
        model.__dict__["_sync"] = sync
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    times = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps + WARMUP):
        ids = torch.randint(0, args.rows, (BATCH, LENGTH), generator=g)
        y = torch.randn(BATCH, generator=g)
        start = time.perf_counter()
        loss = ((model(ids) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        times.append(time.perf_counter() - start)
    steps = args.steps + WARMUP
    if servers:
        t = param_server.traffic(model)["emb"]
        moved, touched = t.total / steps, t.touched / steps
        param_server.shutdown()
    else:
        moved = sum(p.numel() * p.element_size() for p in model.parameters())
        touched = float("nan")
    if rank == 0:
        queue.put((statistics.median(times[WARMUP:]) * 1e3, moved, touched))
    dist.destroy_process_group()


def run(servers: int, staleness: int, transport: str, args) -> tuple[float, float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = args.workers + servers
    ctx_procs = [
        ctx.Process(
            target=worker, args=(r, world, port, servers, staleness, transport, args, queue)
        )
        for r in range(world)
    ]
    for p in ctx_procs:
        p.start()
    result = queue.get(timeout=600)
    for p in ctx_procs:
        p.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    table_mb = args.rows * args.dim * 4 / 2**20
    print(f"table {args.rows} x {args.dim} float32 ({table_mb:.1f} MiB), {args.workers} workers")
    print(f"{'set-up':<12} {'ms/step':>8} {'KiB moved/step':>15} {'KiB touched':>12}")
    for label, servers, staleness, transport in (
        ("replicated", 0, 0, "p2p"),
        ("server s=0", 1, 0, "p2p"),
        ("server s=2", 1, 2, "p2p"),
        ("2 servers", 2, 0, "p2p"),
        ("s=0 rpc", 1, 0, "rpc"),
    ):
        ms, moved, touched = run(servers, staleness, transport, args)
        print(f"{label:<12} {ms:8.1f} {moved / 1024:15.1f} {touched / 1024:12.1f}")


if __name__ == "__main__":
    main()
