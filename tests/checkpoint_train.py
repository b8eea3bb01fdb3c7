"""A tiny data-parallel training run on ``resumable``, for the kill-and-resume tests.

    torchrun --nproc-per-node 2 --max-restarts 3 tests/checkpoint_train.py \
        --dir CKPT --out params.pt --kill 1:7

Runs serially too (``python tests/checkpoint_train.py ...``). Every rank draws the
same global batch and noise (from the global RNG, which the checkpoint restores) and
trains on its slice, so any world size computes the same function; gradients are
summed over ranks. ``--kill RANK:STEP`` SIGKILLs that rank at the start of that step,
on the first attempt only (torchrun's restart count 0). ``--stop STEP`` leaves the
loop after that step, as a job stopped by its scheduler would. Rank 0 writes the
final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist

from macrogen.runtime import groups
from macrogen.runtime.checkpoint import resumable

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--kill", default=None, help="RANK:STEP")
    p.add_argument("--stop", type=int, default=None)
    args = p.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("CKPT_TEST_TIMEOUT", 300)), exit=True)
    torch.set_num_threads(1)
    # The group macrogen makes (as generated code does): restart-safe, so the
    # kill tests show that ensure_initialized rejoins after torchrun restarts the ranks.
    groups.ensure_initialized()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill_rank, kill_step = map(int, args.kill.split(":")) if args.kill else (-1, -1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.Generator().manual_seed(1234)
    x_all = torch.randn(args.steps, GLOBAL_BATCH, 8, generator=data)
    y_all = torch.randn(args.steps, GLOBAL_BATCH, 4, generator=data)
    local = GLOBAL_BATCH // world
    mine = slice(rank * local, (rank + 1) * local)

    loop = resumable(
        range(args.steps),
        model=model,
        optimizer=opt,
        dir=args.dir,
        every=args.every,
        keep=args.keep,
    )
    for step in loop:
        if first_attempt and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        noise = 0.1 * torch.randn(GLOBAL_BATCH, 8)  # the global RNG: restored on resume
        x, y = (x_all[step] + noise)[mine], y_all[step][mine]
        loss = (model(x) - y).pow(2).sum() / GLOBAL_BATCH
        loss.backward()
        if world > 1:
            for param in model.parameters():
                dist.all_reduce(param.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.stop is not None and step == args.stop:
            break
    del loop  # waits for the save in flight and marks it complete
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
