"""Memory per rank and step time of ``mg.parallelize(model, dp="fsdp")`` on gloo ranks.

    python bench/fsdp.py [--ranks 1 2 4] [--d-model 256] [--layers 6] [--steps 10]

For each world size, the same GPT-shaped model (embedding, ``--layers`` blocks of
attention-free MLP and layer norms, a head) is built three ways from the same
weights: torch DDP, macrogen's FSDP (the generated step: ``apply_fully_sharded``)
and FSDP2 written by hand (``fully_shard`` on each block, then the root). After one
AdamW step it reports the bytes each rank holds in parameters, gradients and
optimizer state (local shards), against DDP's (goal: 1/world of DDP's, plus at
most one block's unsharded parameters), then times steps of macrogen's FSDP
against the hand-written one, alternating (goal <= 1.02: the generated code adds
nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 4096):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(
        _local(p.grad).numel() * p.grad.element_size()
        for p in model.parameters()
        if p.grad is not None
    )
    state = sum(
        _local(v).numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return params, grads, state


def _step(model, opt, idx):
    logits = model(idx)
    F.cross_entropy(logits.view(-1, logits.size(-1)), idx.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradients' memory, as a training loop does


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from macrogen.runtime.fully_sharded import FullyShardedConfig, apply_fully_sharded
    from macrogen.runtime.parallelize import device_mesh

    mesh = device_mesh(where="bench/fsdp.py")
    idx = torch.randint(
        0, 4096, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank)
    )
    models = {}
    torch.manual_seed(0)
    models["DDP"] = (
        DDP(GPT(args.d_model, args.layers)) if world > 1 else GPT(args.d_model, args.layers)
    )
    torch.manual_seed(0)
    models["mg fsdp"] = apply_fully_sharded(
        GPT(args.d_model, args.layers), mesh, FullyShardedConfig(), where="bench/fsdp.py"
    )
    torch.manual_seed(0)
    hand = GPT(args.d_model, args.layers)
    if world > 1:
        for block in hand.h:
            fully_shard(block, mesh=mesh.device_mesh)
        fully_shard(hand, mesh=mesh.device_mesh)
    models["FSDP2 by hand"] = hand
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    memory = {}
    for name, model in models.items():
        _step(model, opts[name], idx)
        memory[name] = _held(model, opts[name])
    block = sum(p.numel() * p.element_size() for p in Block(args.d_model).parameters())
    times: dict[str, list[float]] = {"mg fsdp": [], "FSDP2 by hand": []}
    for i in range(args.warmup + args.steps):
        for name in times:  # alternate: the same machine load for both
            dist.barrier()
            start = time.perf_counter()
            _step(models[name], opts[name], idx)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        out.put((memory, block, times))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    from tests.distributed import free_port

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"FSDP: GPT-shaped model d_model {args.d_model}, {args.layers} blocks, AdamW, fp32;"
        f" gloo ranks on {os.cpu_count()} CPUs (load average {load:.1f}); bytes per rank after a step"
    )
    print(f"  {'ranks':>5}  {'run':<14}  {'params':>9}  {'grads':>9}  {'optimizer':>9}  {'total':>9}"
          f"  {'/ DDP':>6}  {'goal':>6}  {'step ms':>8}  {'/ by hand':>9}")  # fmt: skip
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, args, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        memory, block, times = out.get(timeout=1800)
        for p in procs:
            p.join()
        ddp = sum(memory["DDP"])
        goal = (ddp / world + block) / ddp
        hand = statistics.median(times["FSDP2 by hand"])
        for name, (params, grads, state) in memory.items():
            total = params + grads + state
            step = statistics.median(times[name]) if name in times else float("nan")
            ratio = step / hand if name in times else float("nan")
            print(
                f"  {world:>5}  {name:<14}  {params / 2**20:>7.2f}MB  {grads / 2**20:>7.2f}MB"
                f"  {state / 2**20:>7.2f}MB  {total / 2**20:>7.2f}MB  {total / ddp:>6.3f}"
                f"  {goal:>6.3f}  {step * 1e3:>8.1f}  {ratio:>9.3f}"
            )
    print(
        "  / DDP = this run's bytes over DDP's; goal = (DDP / world + one block's parameters) / DDP;"
        " step = median wall time of a step, / by hand = against FSDP2 written by hand (goal <= 1.02)"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
