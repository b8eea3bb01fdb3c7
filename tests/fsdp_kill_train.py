"""A tiny FSDP training run on ``resumable``, for the FSDP kill-and-resume test.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/fsdp_kill_train.py \
        --dir CKPT --out params.pt --kill 1:6

The model is sharded with ``apply_fully_sharded`` (mg.parallelize's dp="fsdp"): each
block, then the root. Every rank draws the same global batch (the global RNG, which
the checkpoint restores) and trains on its slice. ``--kill RANK:STEP`` SIGKILLs that
rank at the start of that step, on the first attempt only. Rank 0 writes the final
full parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

from macrogen.runtime import groups
from macrogen.runtime.checkpoint import resumable
from macrogen.runtime.fully_sharded import FullyShardedConfig, apply_fully_sharded
from macrogen.runtime.mesh import mesh

GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kill", default=None, help="RANK:STEP")
    args = p.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("CKPT_TEST_TIMEOUT", 300)), exit=True)
    torch.set_num_threads(1)
    groups.ensure_initialized()
    rank, world = dist.get_rank(), dist.get_world_size()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill_rank, kill_step = map(int, args.kill.split(":")) if args.kill else (-1, -1)

    torch.manual_seed(0)
    model = apply_fully_sharded(Net(), mesh(), FullyShardedConfig(), where="fsdp_kill_train.py")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.Generator().manual_seed(1234)
    x_all = torch.randn(args.steps, GLOBAL_BATCH, 8, generator=data)
    y_all = torch.randn(args.steps, GLOBAL_BATCH, 4, generator=data)
    local = GLOBAL_BATCH // world
    mine = slice(rank * local, (rank + 1) * local)

    loop = resumable(range(args.steps), model=model, optimizer=opt, dir=args.dir, every=args.every)
    for step in loop:
        if first_attempt and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        noise = 0.1 * torch.randn(GLOBAL_BATCH, 8)  # the global RNG: restored on resume
        x, y = (x_all[step] + noise)[mine], y_all[step][mine]
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del loop  # waits for the save in flight and marks it complete
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:  # (with how often torchrun restarted the job: the test checks it did)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        torch.save({**full, "_restarts": torch.tensor(restarts)}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
