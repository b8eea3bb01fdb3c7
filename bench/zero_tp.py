"""ZeRO-1 over tensor-parallel shards against the same layout's replicated optimizer.

    python bench/zero_tp.py [--hidden 256] [--layers 2] [--steps 20]

4 gloo ranks (data 2 x tensor 2), a transformers Llama from a shrunk config,
``mg.parallelize(model, tp=2, dp=...)`` from one expanded file:

    zero1      dp="zero1" + mg.shard_optimizer(AdamW)      / replicate, AdamW
    zero1_clip ... + torch's clip_grad_norm_ after backward / replicate + the same clip

Each train step is forward, backward, (clip,) AdamW step; the two of a row run
alternately, one step each per round, so a pair sees the same load; rank 0's
median step, the ratio of medians and the median of the paired ratios are
printed, and each rank's optimizer state in bytes (ZeRO-1's is 1/2 of its tensor
shard's). Run-by-run figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SOURCE = textwrap.dedent(
    """
    import torch
    import macrogen as mg
    from transformers import LlamaConfig, LlamaForCausalLM


    def config(hidden, layers):
        return LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=128)


    def replicated(hidden, layers):
        model = mg.parallelize(LlamaForCausalLM(config(hidden, layers)), tp=2,
                               dp="replicate", tp_plan="hf")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


    def zero1(hidden, layers):
        model = mg.parallelize(LlamaForCausalLM(config(hidden, layers)), tp=2, dp="zero1",
                               tp_plan="hf")
        return model, mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    """
)
ROWS = (("zero1", False), ("zero1_clip", True))


def _load(code: str, directory: str):
    import importlib.util

    path = Path(directory) / "zero_tp_bench.py"
    if not path.exists():
        path.write_text(code)
    spec = importlib.util.spec_from_file_location("zero_tp_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["zero_tp_bench"] = module
    spec.loader.exec_module(module)
    return module


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes())
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v = v.to_local() if isinstance(v, DTensor) else v
                total += v.numel() * v.element_size()
    return total


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, code: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    module = _load(code, args.dir)
    from macrogen.runtime.mesh import mesh

    torch.manual_seed(0)
    runs = {
        "replicate": module.replicated(args.hidden, args.layers),
        "zero1": module.zero1(args.hidden, args.layers),
    }
    data_rank = mesh().data_rank
    gen = torch.Generator().manual_seed(1 + data_rank)
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)

    def step(name: str, clip: bool) -> float:
        model, opt = runs[name]
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    results = {}
    for row, clip in ROWS:
        for _ in range(args.warmup):
            step("replicate", clip), step("zero1", clip)
        pairs = [(step("zero1", clip), step("replicate", clip)) for _ in range(args.steps)]
        results[row] = pairs
    states = [None] * world
    dist.all_gather_object(states, {k: _state_bytes(o) for k, (_, o) in runs.items()})
    if rank == 0:
        out.put((results, states))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="rows per data rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    import socket

    from macrogen.expand import expand_source

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 4
    code = expand_source(SOURCE, path="zero_tp_bench.py").code
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = tmp
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, args, code, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results, states = out.get(timeout=1800)
        for p in procs:
            p.join()
    load = os.getloadavg()[0]
    print(
        f"ZeRO-1 over tensor-parallel shards, 4 gloo ranks (data 2 x tensor 2) x 1 thread,"
        f" Llama hidden={args.hidden} layers={args.layers}, {args.batch}x{args.seq} rows per"
        f" data rank, {args.steps} steps each, medians on rank 0; load average {load:.1f} on"
        f" {os.cpu_count()} CPUs"
    )
    print(f"  {'row':<11} {'ZeRO-1 step':>11} {'replicate':>10} {'ratio':>6} {'paired':>6}")
    for row, pairs in results.items():
        ours = statistics.median(a for a, _ in pairs)
        theirs = statistics.median(b for _, b in pairs)
        paired = statistics.median(a / b for a, b in pairs)
        print(
            f"  {row:<11} {ours * 1e3:>8.1f} ms {theirs * 1e3:>7.1f} ms"
            f" {ours / theirs:>6.3f} {paired:>6.3f}"
        )
    for r, s in enumerate(states):
        print(
            f"  rank {r}: optimizer state {s['zero1']:,} B (ZeRO-1) / {s['replicate']:,} B"
            f" (replicate) = {s['zero1'] / s['replicate']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
