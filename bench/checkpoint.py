"""Checkpoint cost: resumable(every=10) with DCP async_save against the plain loop and torch.save.

    python bench/checkpoint.py [--rounds 8] [--every 10] [--dir /tmp/mg-bench-ckpt]

One process trains the GPT of examples/gpt.py at a size whose model + AdamW state is
over 50 MB. Two copies of it take turns, a round of ``every`` steps each: one in a
plain loop, one under ``resumable(every=...)``, so that load from other programs hits
both alike. Prints the added time per step (goal <= 5% of a step), the blocking part
of a save (the copy to host memory, inside the loop's ``next()``), and the save and
load bandwidth of DCP against a plain ``torch.save``/``torch.load`` of the same state
(both fsynced on save: DCP's FileSystemWriter fsyncs every file by default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.gpt import build  # noqa: E402
from macrogen.runtime.checkpoint import resumable  # noqa: E402

MODEL = dict(n_layer=6, n_embd=256, n_head=8, vocab_size=1024, block_size=64, batch_size=4)


def state_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    msd, osd = get_state_dict(model, optimizers=opt)
    sizes = [t.numel() * t.element_size() for t in msd.values()]
    sizes += [t.numel() * t.element_size() for s in osd["state"].values() for t in s.values()
              if isinstance(t, torch.Tensor)]  # fmt: skip
    return sum(sizes) / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="mg-bench-ckpt-"))
    shutil.rmtree(root, ignore_errors=True)

    plain_model, plain_step = build(**MODEL)
    model, step = build(**MODEL)
    opt = _optimizer_of(step)
    plain_step(), step()  # warm up; AdamW state exists from here
    mb = state_mb(model, opt)

    steps = args.rounds * args.every
    loop = resumable(range(steps), model=model, optimizer=opt, dir=root / "loop", every=args.every)
    plain, checkpointed, blocking = [], [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.every):
            plain_step()
        plain.append((time.perf_counter() - t0) / args.every)
        t0 = time.perf_counter()
        for _ in range(args.every):
            t1 = time.perf_counter()
            next(loop)  # the save of the previous round starts in here
            blocking.append(time.perf_counter() - t1)
            step()
        checkpointed.append((time.perf_counter() - t0) / args.every)
    del loop

    # Bandwidth, synchronously, the same state: DCP (what resumable writes) and torch.save.
    msd, osd = get_state_dict(model, optimizers=opt)
    state = {"model": msd, "optim": osd}
    dcp_save, dcp_load, pt_save, pt_load = [], [], [], []
    for i in range(3):
        path = root / f"dcp{i}"
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path, no_dist=True)
        dcp_save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        dcp_load.append(time.perf_counter() - t0)
        file = root / f"plain{i}.pt"
        t0 = time.perf_counter()
        with open(file, "wb") as f:  # fsynced, as DCP's FileSystemWriter does by default
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        pt_save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(file)
        pt_load.append(time.perf_counter() - t0)
    shutil.rmtree(root, ignore_errors=True)

    step_s = statistics.median(plain)
    added = statistics.median(checkpointed) - step_s
    block = sorted(blocking)[-args.rounds + 1 :] if args.rounds > 1 else blocking  # the save steps
    print(f"GPT {MODEL}: {mb:.1f} MB of model + AdamW state, 1 process, every={args.every}")
    print(f"  plain step:              {step_s * 1e3:8.1f} ms (median of {args.rounds} rounds)")
    print(f"  step under resumable:    {statistics.median(checkpointed) * 1e3:8.1f} ms")
    print(f"  added per step:          {added * 1e3:8.1f} ms = {added / step_s:6.1%} of a step"
          " (goal <= 5%)")  # fmt: skip
    print(f"  blocking part of a save: {statistics.median(block) * 1e3:8.1f} ms"
          f" = {statistics.median(block) / step_s:.2f} steps")  # fmt: skip
    for name, dcp_t, pt_t in (("save", dcp_save, pt_save), ("load", dcp_load, pt_load)):
        d, t = statistics.median(dcp_t), statistics.median(pt_t)
        print(f"  {name}: DCP {mb / d:7.0f} MB/s, torch.{name} {mb / t:7.0f} MB/s"
              f" (DCP / torch: {t / d:.2f} x the bandwidth)")  # fmt: skip


def _optimizer_of(step) -> torch.optim.Optimizer:
    """The AdamW inside examples.gpt.build's step closure."""
    cells = {c.cell_contents for c in step.__closure__ or ()
             if isinstance(c.cell_contents, torch.optim.Optimizer)}  # fmt: skip
    (opt,) = cells
    return opt


if __name__ == "__main__":
    main()
