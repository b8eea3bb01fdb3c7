"""Train-step time of @tensor_parallel vs torch's DTensor tensor parallelism, 2 gloo ranks.

    python bench/tp.py [--d-model 128 256 512] [--n-head 8] [--batch 8] [--seq 64] [--steps 40]
                       [--vocab 8192] [--breakdown] [--profile]

Both sides train the same transformer block (attention: qkv colwise, proj
rowwise, n_head divided; MLP: fc colwise, proj rowwise) from the same weights:
macrogen's expanded class, and the serial class handed to
``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel /
RowwiseParallel on a CPU DeviceMesh. A step is forward, backward and an SGD
step. Steps alternate between the two in one run (same machine load), each
starts after a barrier, and the figure is the ratio of median step times
(rank 0's clock; goal <= 0.70), for each model width, in wall time and in
CPU time (rank 0's process, gloo's threads included: less moved by other
jobs on the machine than wall time). Before timing, both outputs are checked
equal. Other processes on the machine add noise: the load average is
printed with the results.

"plain shards" is what the tensor-parallel parameters cost: a copy of macrogen's block whose
DTensor parameters are replaced by plain parameters holding the same local shards, with the
engine's per-forward swap to local tensors removed (the planned layers' forwards and
collectives as they are; its results are the model's). The `@tensor_parallel / plain shards`
line is the engine's price for DTensor parameters (goal <= 1.02: the decorator no slower than
it was on plain shards); ``--profile`` adds where rank 0's CPU goes in one step of each.

"no collectives" is the floor: a copy of macrogen's block run with every
all-reduce skipped, so each rank runs the same per-rank matmuls, attention and
layer norms with no communication at all (its results are not the model's). No tensor-parallel implementation on this machine's two ranks
can beat it; its ratio says how far below DTensor free communication would
get. Per phase (forward, backward, optimizer step) medians follow, then the CPU
of a step split between the Python thread and the others (gloo's transport).
``--breakdown`` adds macrogen's step with every all-reduce reducing 4 bytes
(the collectives' synchronization without their data) and with no all-reduce
at all (macrogen's own code path, without communication): timing only.

Last, it measures the logits one rank holds for the loss of a
vocabulary-split head (``F.cross_entropy`` rewritten to the vocab-parallel
loss) against the serial head's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BLOCK = """
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


@mg.tensor_parallel(plan={"qkv": "colwise", "proj": "rowwise", "n_head": "divide"})
class Attention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_head, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


@mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


@mg.tensor_parallel(plan={"head": "colwise"})
class Head(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x, targets):
        logits = self.head(x)  # vocab-split: (B, T, vocab / tp) on each rank
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# Sequence parallel: between the halves each rank holds (B, T / tp, C)
@mg.tensor_parallel(plan={"qkv": "colwise", "proj": "rowwise to sequence", "n_head": "divide"})
class AttentionSP(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_head, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


@mg.tensor_parallel(plan={"fc": "colwise from sequence", "proj": "rowwise to sequence"})
class MLPSP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


@mg.tensor_parallel(plan={"ln_1": "sequence", "attn": "from sequence", "ln_2": "sequence"})
class BlockSP(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = AttentionSP(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLPSP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
"""


def _load(code: str, name: str, directory: str):
    import importlib.util

    path = Path(directory) / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _torch_tp(serial: torch.nn.Module, world: int, sequence: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    block = copy.deepcopy(serial)
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    if sequence:  # torch's sequence parallelism: the layer norms on sequence slices
        plan.update({
            "ln_1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip
    block = parallelize_module(block, mesh, plan)
    block.attn.n_head //= world  # torch leaves head counts to the user
    return block


PHASES = ("forward", "backward", "optimizer")


def _parallelized(serial: torch.nn.Module, world: int) -> torch.nn.Module:
    """The serial block through ``mg.parallelize``'s apply step (what its expansion calls)."""
    from macrogen.runtime.parallelize import apply_tensor_parallel, device_mesh

    plan = {"attn.qkv": "colwise", "attn.proj": "rowwise", "attn.n_head": "divide",
            "mlp.fc": "colwise", "mlp.proj": "rowwise"}  # fmt: skip
    model = copy.deepcopy(serial)
    return apply_tensor_parallel(model, device_mesh(tp=world, planned=True, where="bench"), plan,
                                 where="bench")  # fmt: skip


def _clocks() -> tuple[float, float, float]:
    return time.perf_counter(), time.process_time(), time.thread_time()


def _step(model, opt, x) -> list[tuple[float, float, float]]:
    """(wall, process CPU, this thread's CPU) seconds of each phase of one step."""
    clocks = [_clocks()]
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    clocks.append(_clocks())
    loss.backward()
    clocks.append(_clocks())
    opt.step()
    clocks.append(_clocks())
    return [tuple(b[i] - a[i] for i in range(3)) for a, b in zip(clocks, clocks[1:])]


def _plain_shards(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the engine's ``model`` on plain parameters (its DTensors' local shards) and
    without the per-forward swap: the planned layers' forwards and collectives unchanged."""
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.parallelize.local import detach

    plain = copy.deepcopy(model)
    for module in plain.modules():
        detach(module)
        for key, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                module._parameters[key] = torch.nn.Parameter(p.to_local().detach().clone())
    return plain


def _profile(model, opt, x, steps: int = 10) -> str:
    """rank 0's CPU by operator over ``steps`` steps (torch.profiler), the top rows (the
    profiler's CPU is the thread's wall time: run it with the all-reduces skipped)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(model, opt, x)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


class _FourByteReductions:
    """torch.distributed for macrogen's collectives, except that each all-reduce reduces 4 bytes:
    what a collective costs without its data (waking gloo's threads, waiting, the round trip).
    Timing only: the model's results are wrong."""

    def __init__(self):
        self.one = torch.zeros(1)

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, group=None, async_op=False):
        return dist.all_reduce(self.one, group=group, async_op=async_op)


class _Done:
    def wait(self) -> bool:
        return True


class _NoReductions(_FourByteReductions):
    """Every all-reduce skipped: macrogen's own per-rank work, its layers' code path included."""

    def all_reduce(self, tensor, group=None, async_op=False):
        return _Done() if async_op else None


def _logit_memory(serial_mod, ours_mod, args, world):
    """Bytes of logits one rank holds for the loss: serial vs vocab-parallel (the loss equal)."""
    d_model, vocab = args.d_model[0], args.vocab
    g = torch.Generator().manual_seed(3)
    x = torch.randn(args.batch, args.seq, d_model, generator=g)
    targets = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    sizes = []
    for mod in (serial_mod, ours_mod):
        torch.manual_seed(0)
        head = mod.Head(d_model, vocab)
        seen = []
        head.head.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(o.untyped_storage().nbytes())
        )
        loss = head(x, targets)
        loss.backward()
        sizes.append((seen[0], loss.item()))
    (serial_bytes, serial_loss), (ours_bytes, ours_loss) = sizes
    assert abs(ours_loss - serial_loss) <= 1e-5 * abs(serial_loss), (ours_loss, serial_loss)
    return serial_bytes, ours_bytes, vocab


def _layer_norm_saved_bytes(out: torch.Tensor) -> int:
    """Bytes autograd keeps for the layer norms (their input, the residual stream, mean, rstd)."""
    total, seen, todo = 0, set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "NativeLayerNormBackward0":
            for name in ("_saved_input", "_saved_result1", "_saved_result2"):
                t = getattr(node, name)
                total += t.numel() * t.element_size()
        todo.extend(n for n, _ in node.next_functions)
    return total


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    os.environ["MACROGEN_TP_SIZE"] = str(world)  # 2-way tensor parallelism
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from macrogen.expand import expand_source
    from macrogen.runtime import collectives, collectives_linear, collectives_sequence

    def transport(via) -> None:  # the torch.distributed every tensor-parallel collective calls
        for module in (collectives, collectives_linear, collectives_sequence):
            module.dist = via

    with tempfile.TemporaryDirectory() as tmp:
        serial_mod = _load(BLOCK, "tp_bench_serial", tmp)
        ours_mod = _load(expand_source(BLOCK, path="block.py").code, "tp_bench_ours", tmp)
    results, memory, profiles = [], [], []
    for d_model in args.d_model:
        torch.manual_seed(0)
        serial = serial_mod.Block(d_model, args.n_head)
        torch.manual_seed(0)
        ours = ours_mod.Block(d_model, args.n_head)
        theirs = _torch_tp(serial, world)
        torch.manual_seed(0)
        ours_sp = ours_mod.BlockSP(d_model, args.n_head)
        theirs_sp = _torch_tp(serial, world, sequence=True)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.seq, d_model, generator=g)
        mine = x.chunk(world, dim=1)[rank].contiguous()  # my slice of the sequence
        with torch.no_grad():  # same weights, same answer
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours_sp(mine), theirs_sp(mine), rtol=1e-5, atol=1e-5)
        memory.append((_layer_norm_saved_bytes(serial(x)), _layer_norm_saved_bytes(ours_sp(mine))))
        built = _parallelized(serial, world)
        with torch.no_grad():
            torch.testing.assert_close(built(x), theirs(x), rtol=1e-5, atol=1e-5)
        sgd = torch.optim.SGD(ours.parameters(), lr=1e-3)
        _step(ours, sgd, x)  # a first step with its collectives: its first-backward checks pass
        floor = copy.deepcopy(ours)  # its own weights: it runs with every all-reduce skipped
        plain = _plain_shards(ours)  # its own weights, on plain parameters
        with torch.no_grad():
            torch.testing.assert_close(plain(x), ours(x), rtol=0, atol=0)
        runs = {  # name: (model, optimizer, collectives_linear.OVERLAP, input[, transport])
            "macrogen": (ours, sgd, True, x),  # the default: collectives overlap compute
            "no overlap": (ours, sgd, False, x),  # collectives_linear.OVERLAP = False
            "no collectives": (
                floor,
                torch.optim.SGD(floor.parameters(), lr=1e-3),
                True,
                x,
                _NoReductions(),
            ),
            "plain shards": (plain, torch.optim.SGD(plain.parameters(), lr=1e-3), True, x),
            "torch DTensor": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3), True, x),
            "mg.parallelize": (built, torch.optim.SGD(built.parameters(), lr=1e-3), True, x),
            "macrogen SP": (ours_sp, torch.optim.SGD(ours_sp.parameters(), lr=1e-3), True, mine),
            "torch DTensor SP": (
                theirs_sp,
                torch.optim.SGD(theirs_sp.parameters(), lr=1e-3),
                True,
                mine,
            ),
        }
        if args.breakdown:  # macrogen's step with its all-reduces moving 4 bytes, and with none
            runs["tiny all-reduces"] = (ours, sgd, True, x, _FourByteReductions())
            runs["no all-reduces"] = (ours, sgd, True, x, _NoReductions())
        times: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in runs}
        for i in range(args.warmup + args.steps):
            for name, (model, opt, overlap, x, *via) in runs.items():  # alternate: same load
                collectives_linear.OVERLAP = overlap
                transport(via[0] if via else dist)
                dist.barrier()
                phases = _step(model, opt, x)
                if i >= args.warmup:
                    times[name].append(phases)
        collectives_linear.OVERLAP = True
        transport(dist)
        if args.profile:  # with the all-reduces skipped: compute and the engine, no waits
            transport(_NoReductions())
            for name in ("macrogen", "plain shards", "mg.parallelize"):
                model, opt, _, x, *_ = runs[name]
                table = _profile(model, opt, x)
                profiles.append(f"{d_model}  {name}\n{table}")
            transport(dist)
        results.append((d_model, times))
    logits = _logit_memory(serial_mod, ours_mod, args, world)
    if rank == 0:
        out.put((results, logits, memory, profiles))
    dist.barrier()
    dist.destroy_process_group()


def _totals(steps: list[list[tuple[float, float]]], clock: int) -> list[float]:
    """Each step's total over its phases, on the wall (0), process CPU (1) or thread CPU (2) clock."""
    return [sum(phase[clock] for phase in step) for step in steps]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of the loss check")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print rank 0's CPU by operator for macrogen, plain shards and mg.parallelize",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time macrogen with 4-byte all-reduces and with none (what the reductions cost)",
    )
    args = parser.parse_args(argv)

    from tests.distributed import free_port

    world, port = 2, free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results, (serial_bytes, ours_bytes, vocab), memory, profiles = out.get(timeout=1800)
    for p in procs:
        p.join()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"tensor-parallel train step (forward, backward, SGD), 2 gloo ranks x {args.threads}"
        f" thread, transformer block n_head={args.n_head}, batch {args.batch}x{args.seq},"
        f" {args.steps} steps each, medians on rank 0; load average {load:.1f} on"
        f" {os.cpu_count()} CPUs"
    )
    print(
        f"  {'d_model':>7}  {'run':<16}  {'median step':>11}  {'ratio':>6}  {'paired':>6}"
        f"  {'CPU/step':>9}  {'CPU ratio':>9}"
    )
    for d_model, times in results:
        for name, steps in times.items():
            peer = times["torch DTensor SP" if name.endswith("SP") else "torch DTensor"]
            mine, theirs = _totals(steps, 0), _totals(peer, 0)
            # steps of one round ran back to back: a pair saw the same load
            paired = statistics.median(a / b for a, b in zip(mine, theirs))
            ratio = statistics.median(mine) / statistics.median(theirs)
            cpu = statistics.median(_totals(steps, 1))
            cpu_ratio = cpu / statistics.median(_totals(peer, 1))
            print(
                f"  {d_model:>7}  {name:<16}  {statistics.median(mine) * 1e3:>8.2f} ms"
                f"  {ratio:>6.3f}  {paired:>6.3f}  {cpu * 1e3:>6.2f} ms  {cpu_ratio:>9.3f}"
            )
    print(
        "  ratio = median step / median DTensor step (wall); paired = median of the per-round"
        " ratios (robust to load changes); CPU = rank 0's process CPU time (gloo's threads"
        " included); SP rows against torch DTensor SP (SequenceParallel);"
        " no collectives = the floor (no communication). Goal for macrogen: <= 0.70"
    )
    for d_model, times in results:
        mine, ours = _totals(times["mg.parallelize"], 0), _totals(times["macrogen"], 0)
        print(
            f"  {d_model:>7}  mg.parallelize / @tensor_parallel (DTensor parameters, local"
            f" forward vs plain shards): {statistics.median(mine) / statistics.median(ours):.3f}"
            f" (paired {statistics.median(a / b for a, b in zip(mine, ours)):.3f}; goal <= 1.05)"
        )
    for d_model, times in results:
        mine, plain = times["macrogen"], times["plain shards"]
        cpu = statistics.median(_totals(mine, 1)) / statistics.median(_totals(plain, 1))
        wall = statistics.median(_totals(mine, 0)) / statistics.median(_totals(plain, 0))
        print(
            f"  {d_model:>7}  @tensor_parallel / plain shards (what DTensor parameters cost): CPU"
            f" {cpu:.3f}, wall {wall:.3f} (goal <= 1.02)"
        )
    print("  per phase, median wall / CPU ms:")
    for d_model, times in results:
        for name, steps in times.items():
            cells = "  ".join(
                f"{phase} {statistics.median(s[k][0] for s in steps) * 1e3:6.2f}"
                f" / {statistics.median(s[k][1] for s in steps) * 1e3:6.2f}"
                for k, phase in enumerate(PHASES)
            )
            print(f"  {d_model:>7}  {name:<16}  {cells}")
    print(
        "  CPU of a step by thread, median ms: the Python thread (compute, waits) / the rest (gloo's):"
    )
    for d_model, times in results:
        for name, steps in times.items():
            main_cpu = statistics.median(_totals(steps, 2))
            rest = statistics.median(a - b for a, b in zip(_totals(steps, 1), _totals(steps, 2)))
            print(f"  {d_model:>7}  {name:<16}  {main_cpu * 1e3:6.2f} / {rest * 1e3:5.2f}")
    for d_model, (serial_ln, sp_ln) in zip(args.d_model, memory):
        print(
            f"sequence parallel, d_model {d_model}: layer-norm activations saved per rank"
            f" {sp_ln / 2**10:.1f} KiB vs serial {serial_ln / 2**10:.1f} KiB"
            f" (/ {serial_ln / sp_ln:.2f}; tp = {world})"
        )
    for table in profiles:
        print(f"rank 0's CPU by operator, 10 steps with the all-reduces skipped, d_model {table}")
    print(
        f"vocab-parallel cross-entropy, vocab {vocab}, batch {args.batch}x{args.seq}: logits per"
        f" rank {ours_bytes / 2**20:.2f} MiB vs serial {serial_bytes / 2**20:.2f} MiB"
        f" (/ {serial_bytes / ours_bytes:.2f}; tp = {world}), loss equal to serial"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
