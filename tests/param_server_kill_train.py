"""A tiny parameter-server run on ``resumable``, for the server kill-and-resume test.

    torchrun --nproc-per-node 3 --max-restarts 1 tests/param_server_kill_train.py \
        --dir CKPT --out state.pt --kill 1:5

Ranks 0 and 1 are workers, rank 2 the server: a 10k-row embedding with Adagrad on
the server, a dense head data-parallel between the workers (SGD), float64. Batches
are drawn per step from a seeded generator (the same on every attempt).
``--kill RANK:STEP`` SIGKILLs that rank at the start of that step, on the first
attempt only; torchrun then restarts every rank, the server included. Worker 0
writes the final dense parameters, tables and Adagrad sums to ``--out``, with the
restart count and the step the last attempt started at.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import groups, param_server
from macrogen.runtime.checkpoint import resumable
from macrogen.runtime.data_parallel import DataParallelConfig

ROWS, DIM, BATCH, LENGTH = 10_000, 8, 8, 16


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids).mean(1))).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill", default=None, help="RANK:STEP")
    args = p.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("CKPT_TEST_TIMEOUT", 300)), exit=True)
    torch.set_num_threads(1)
    groups.ensure_initialized()
    rank = dist.get_rank()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank, kill_step = map(int, args.kill.split(":")) if args.kill else (-1, -1)

    torch.manual_seed(0)
    model = Rec().double()
    config = param_server.ServerConfig(1, 0, "adagrad", 0.5, timeout_s=60)
    # a server serves here until the workers shut down, then exits 0
    param_server.apply_param_server(
        model, [("emb", model.emb)], config, where="param_server_kill_train.py",
        data_parallel=DataParallelConfig(),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = resumable(range(args.steps), model=model, optimizer=opt, dir=args.dir, every=args.every)
    first = None  # the step this attempt started at (4 after a resume from step 4's checkpoint)
    for step in loop:
        first = step if first is None else first
        if restarts == 0 and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, ROWS, (2, BATCH, LENGTH), generator=g)[rank]
        y = torch.randn(2, BATCH, generator=g, dtype=torch.float64)[rank]
        loss = ((model(ids) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    del loop  # waits for the save in flight and marks it complete
    state = param_server.state_dict(model)
    state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    if rank == 0:  # (with how often torchrun restarted the job: the test checks it did)
        marks = {"_restarts": torch.tensor(restarts), "_first": torch.tensor(first)}
        torch.save({**state, **marks}, args.out)
    param_server.shutdown()


if __name__ == "__main__":
    main()
