"""Expert parallelism (``mg.parallelize(model, ep=2)``) vs tensor parallelism inside the experts
(``tp=2, tp_plan="hf"``: transformers' ``moe_tp_experts``) vs the serial model, 2 gloo ranks.

    python bench/experts.py [--hidden 256] [--experts 8] [--inner 512] [--rows 8] [--seq 64]
                            [--steps 12]

A transformers Qwen2-MoE (2 layers, top-2 routing, float32, eager experts) trains on the same
global batch of ``rows`` x ``seq`` tokens per step, AdamW: under ep=2 each rank takes half the
rows (the other dim is data parallel); under tp=2 both ranks take all rows, each computing its
half of every expert; serially rank 0 takes all rows while rank 1 waits. And ep=2 with
``dp="fsdp"`` (experts over ep, FSDP over the rest) beside FSDP alone, each rank its half of
the rows. Steps alternate between the five in one run (the same machine load), each after a barrier; the figures are
median step times on rank 0's clock and their ratios, in wall time and in rank 0's process
CPU time (gloo's threads included: less moved by other jobs on the machine). Before timing,
the three give the same loss on a first batch.

Bytes: the routing all-to-alls' bytes per step, as counted by the router (forward: the pairs'
hidden states out, the experts' outputs back; backward: their gradients), beside the routed
tokens' size, tokens x top_k x hidden x 4 bytes per MoE layer each way, which they equal;
and tp's all-reduce bytes of the experts' outputs (tokens x hidden x 4 per MoE layer, forward
and backward), its whole-batch price for the same tokens.
"""

from __future__ import annotations

import argparse
import copy
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


def tp(model):
    return mg.parallelize(model, tp=2, tp_plan="hf", dp="none")


def ep_fsdp(model):
    return mg.parallelize(model, ep=2, dp="fsdp")


def fsdp(model):
    return mg.parallelize(model, dp="fsdp")
"""


def _config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.inner, shared_expert_intermediate_size=args.inner,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_experts=args.experts, num_experts_per_tok=2, experts_implementation="eager",
        attention_dropout=0.0,
    )  # fmt: skip


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> dict:
    import warnings

    import torch.distributed as dist
    import transformers

    from macrogen.runtime import mesh
    from macrogen.runtime.expert_parallel import expert_parallel_of
    from tests.helpers import expand, load_module

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    module = load_module(expand(SOURCE), f"bench_experts_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = transformers.Qwen2MoeForCausalLM(_config(args))
    ep_model = module.ep(copy.deepcopy(serial))
    mesh.reset()  # (one mesh per program: each model keeps the groups it was given)
    tp_model = module.tp(copy.deepcopy(serial))
    mesh.reset()
    ep_fsdp_model = module.ep_fsdp(copy.deepcopy(serial))
    mesh.reset()
    fsdp_model = module.fsdp(copy.deepcopy(serial))
    half = args.rows // world
    mine = slice(rank * half, (rank + 1) * half)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1024, (args.rows, args.seq), generator=gen)
               for _ in range(args.steps + 1)]  # fmt: skip
    runs = {
        "ep=2": (ep_model, mine),
        "tp=2 (moe_tp_experts)": (tp_model, slice(None)),
        "serial": (serial, slice(None)),
        "ep=2 x fsdp": (ep_fsdp_model, mine),
        "fsdp (no ep)": (fsdp_model, mine),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, (m, _) in runs.items()}

    stepping: dict[str, list[float]] = {name: [] for name in runs}

    def step(name: str, ids: torch.Tensor) -> float:
        model, rows = runs[name]
        if name == "serial" and rank != 0:
            return 0.0
        loss = model(input_ids=ids[rows], labels=ids[rows], use_cache=False).loss
        loss.backward()
        start = time.perf_counter()
        optimizers[name].step()
        optimizers[name].zero_grad()
        stepping[name].append(time.perf_counter() - start)
        return float(loss)

    first = {}
    for name in runs:
        dist.barrier()
        first[name] = step(name, batches[0])
    for name in ("ep=2", "ep=2 x fsdp", "fsdp (no ep)"):  # each rank its rows: their mean
        loss = torch.tensor(first[name])
        dist.all_reduce(loss)
        first[name] = float(loss) / world
    state = expert_parallel_of(ep_model)
    assert state is not None
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    state.traffic.reset()
    for ids in batches[1:]:
        for name in runs:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            step(name, ids)
            times[name].append(time.perf_counter() - start)
            cpus[name].append(time.process_time() - cpu)
    traffic = state.traffic
    layers = len(state.experts)
    tokens = half * args.seq
    return {
        "first losses": first,
        "median s": {name: statistics.median(t) for name, t in times.items()},
        "cpu s": {name: statistics.median(t) for name, t in cpus.items()},
        "optimizer s": {name: statistics.median(t or [0.0]) for name, t in stepping.items()},
        "a2a bytes per step": (traffic.dispatched + traffic.combined + traffic.backward)
        / args.steps,
        "dispatched per step": traffic.dispatched / args.steps,
        "combined per step": traffic.combined / args.steps,
        "backward per step": traffic.backward / args.steps,
        "counts per step": traffic.counts / args.steps,
        "routed size": layers * tokens * 2 * args.hidden * 4,
        "tp all-reduce bytes": 2 * layers * args.rows * args.seq * args.hidden * 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_worker, 2, args=(args, tmp), timeout=1800)
    r0 = results[0]
    print(f"Qwen2-MoE, hidden {args.hidden}, {args.experts} experts x {args.inner}, top-2,"
          f" 2 layers, {args.rows} x {args.seq} tokens per step, float32, 2 gloo ranks")  # fmt: skip
    print("first losses:", {k: round(v, 6) for k, v in r0["first losses"].items()})
    medians = r0["median s"]
    for name, seconds in medians.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms/step, CPU {r0['cpu s'][name] * 1e3:8.1f} ms"
              f" (of which AdamW {r0['optimizer s'][name] * 1e3:6.1f} ms)")  # fmt: skip
    cpu = r0["cpu s"]
    print(f"ep / tp: {medians['ep=2'] / medians['tp=2 (moe_tp_experts)']:.2f}"
          f" (CPU {cpu['ep=2'] / cpu['tp=2 (moe_tp_experts)']:.2f});"
          f" ep / serial: {medians['ep=2'] / medians['serial']:.2f}"
          f" (CPU {cpu['ep=2'] / cpu['serial']:.2f})")  # fmt: skip
    print(f"ep x fsdp / fsdp: {medians['ep=2 x fsdp'] / medians['fsdp (no ep)']:.2f}"
          f" (CPU {cpu['ep=2 x fsdp'] / cpu['fsdp (no ep)']:.2f})")  # fmt: skip
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: all-to-all {r['a2a bytes per step']:.0f} B/step (dispatched"
            f" {r['dispatched per step']:.0f}, combined {r['combined per step']:.0f}, backward"
            f" {r['backward per step']:.0f}, counts {r['counts per step']:.0f}); routed tokens'"
            f" size {r['routed size']} B each way"
        )
    combined = sum(r["combined per step"] for r in results)
    routed = sum(r["routed size"] for r in results)
    print(f"over the ranks: dispatched = combined = routed size: {combined == routed}"
          f" ({routed} B each way); tp's all-reduce of the experts' outputs:"
          f" {r0['tp all-reduce bytes']} B per rank per step")  # fmt: skip
    print("load average:", " ".join(f"{x:.2f}" for x in __import__("os").getloadavg()))


if __name__ == "__main__":
    main()
