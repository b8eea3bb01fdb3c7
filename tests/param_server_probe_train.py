"""A parameter-server job that waits at a gate, so that a test can probe its ports mid-run.

    (3 ranks, torchrun's variables) python tests/param_server_probe_train.py \
        --gate DIR --out state.pt [--transport p2p|rpc]

Ranks 0 and 1 are workers, rank 2 the server (a 1,000-row embedding, Adagrad; a dense
head data-parallel between the workers; float64). Every rank writes ``DIR/pid_RANK``
once the job is set up; the workers train ``--before`` steps, write ``DIR/ready_RANK``,
wait for ``DIR/go`` (the test's probe is done), train the remaining steps, and worker
0 writes the tables and the dense parameters to ``--out``. The process group is made
by macrogen's own start-up (``groups.ensure_initialized``), as an expanded program does.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from macrogen.runtime import groups, param_server
from macrogen.runtime.data_parallel import DataParallelConfig

ROWS, DIM, BATCH, LENGTH, LR = 1_000, 8, 4, 8, 0.5


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids).mean(1))).squeeze(-1)


def build() -> Rec:
    torch.manual_seed(0)
    return Rec().double()


def batch(step: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of all workers (worker w's rows: w * BATCH ...)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, ROWS, (workers * BATCH, LENGTH), generator=g)
    return ids, torch.randn(workers * BATCH, generator=g, dtype=torch.float64)


def serial(steps: int, workers: int = 2) -> dict[str, torch.Tensor]:
    """The program on one process: dense table (Adagrad), dense head (SGD)."""
    model = build()
    dense = torch.optim.SGD(model.head.parameters(), lr=0.1)
    sparse = torch.optim.Adagrad([model.emb.weight], lr=LR)
    for t in range(steps):
        ids, y = batch(t, workers)
        loss = ((model(ids) - y) ** 2).mean()
        dense.zero_grad()
        sparse.zero_grad()
        loss.backward()
        dense.step()
        sparse.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gate", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--before", type=int, default=2)
    p.add_argument("--transport", default="p2p")
    args = p.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("PROBE_TEST_TIMEOUT", 120)), exit=True)
    torch.set_num_threads(1)
    groups.ensure_initialized()
    import torch.distributed as dist

    rank, gate = dist.get_rank(), Path(args.gate)
    (gate / f"pid_{rank}").write_text(str(os.getpid()))
    model = build()
    config = param_server.ServerConfig(1, 0, "adagrad", LR, timeout_s=90, transport=args.transport)
    param_server.apply_param_server(  # the server serves here, then exits 0
        model, [("emb", model.emb)], config, where="probe", data_parallel=DataParallelConfig()
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if step == args.before:
            (gate / f"ready_{rank}").write_text("")
            deadline = time.monotonic() + 60
            while not (gate / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        ids, y = batch(step, 2)
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = ((model(ids[part]) - y[part]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = param_server.state_dict(model)
    state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    if rank == 0:
        torch.save(state, args.out)
    param_server.shutdown()


if __name__ == "__main__":
    main()
