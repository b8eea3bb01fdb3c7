"""Data-parallel step time: @data_parallel, ZeRO-1 and local SGD against torch DDP.

    python bench/ddp.py [--steps 4] [--rounds 6]
    python bench/ddp.py --curve docs/local_sgd_loss.png [--curve-steps 300]
    python bench/ddp.py --profile       # where each variant's time goes (cProfile, rank 0)
    python bench/ddp.py --compile [--backend inductor]   # both under torch.compile

Two gloo ranks on this machine train the GPT of examples/gpt.py (6 layers,
d=256) with AdamW, and a small conv net with BatchNorm (written here) with SGD.
Every variant lives in the same two processes and the variants take turns,
``--steps`` steps each (timed together, ZeRO-1's last all-gather included), so
that load from other programs hits them alike. Prints each variant's median
step time, rank 0's CPU time per step (all threads), the
collective calls per step, the optimizer-state bytes per rank, and the ratios
to torch DDP measured in the same run:

    macrogen          @data_parallel, AdamW                       / DDP, AdamW
    zero1             @data_parallel + mg.shard_optimizer(AdamW)  / DDP, AdamW
    zero1_fused       ... + shard_optimizer(AdamW(fused=True))    / DDP, AdamW(fused=True)
    zero1_clip        ... + torch clip_grad_norm_ after backward  / DDP + the same clip
    zero1_mgclip      ... + mg.clip_grad_norm_(opt, c) instead    / DDP + torch's clip
    sync4             @data_parallel(sync_every=4), AdamW         / DDP, AdamW
    ddp_zero          DDP + torch ZeroRedundancyOptimizer(AdamW)  / DDP, AdamW
    zero1_floor       DDP, AdamW over half the elements only      / DDP, AdamW
    macrogen_bn       @data_parallel conv net with BatchNorm, SGD / DDP, SGD
    bn_floor          the conv net, no communication at all, SGD  / DDP, SGD
    bn_allreduce      bn_floor + one blocking all-reduce of as many bytes as its gradients

The floors bound what any change can reach here: zero1_floor is ZeRO-1
with nothing of its own (DDP's collectives, 1/world of the optimizer work),
bn_floor is data parallelism whose communication costs nothing, and
bn_allreduce one whose only cost is moving the gradients' bytes once with
gloo's all-reduce (not overlapped; the rank-to-rank lockstep included).

``--compile`` times the GPT under ``torch.compile`` applied after the wrapper:
``torch.compile(@data_parallel GPT)`` against ``torch.compile(DDP(GPT))``, same
bucket size (DDP's compiled graph is split at its buckets by DDPOptimizer), AdamW
uncompiled on both, and prints the ratio (goal <= 1.0), the graphs each compiled
and its graph breaks, any recompilation during the timed rounds, and the losses of
both (equal up to rounding: same weights, same batches).

``--curve`` trains the GPT example (2 layers, d=64, byte-level text of this
repository's docs) for a few hundred steps with sync_every = 1, 8 and 32, each
with plain averaging, the outer Nesterov step and that step overlapped
(bench/local_sgd.py's ``--losses`` runs), and draws the loss curves into a PNG
with matplotlib. matplotlib is needed by that
mode only (``pip install matplotlib``); it is not a macrogen dependency.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(n_layer=6, n_embd=256, n_head=8, vocab_size=1024, block_size=64)
BATCH = 2  # sequences per rank
IMAGES = 16  # conv net: 3x32x32 images per rank
BUCKET_MB = 25  # torch DDP's default bucket_cap_mb; both sides use it

# Expanded once per run: each class is a data-parallel model; the serial ones are for DDP.
SOURCE = """
import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg
from examples.gpt import GPT


class ConvNet(nn.Module):
    \"\"\"Four conv-BatchNorm-ReLU stages (ResNet-like widths), global pooling, a linear head.\"\"\"

    def __init__(self, classes=10):
        super().__init__()
        stages, width = [], 3
        for out, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
            stages += [nn.Conv2d(width, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True), nn.Conv2d(out, out, 3, 1, 1, bias=False),
                       nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            width = out
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        logits = self.head(self.features(x).mean((2, 3)))
        return F.cross_entropy(logits, y)


@mg.data_parallel(bucket_mb={bucket_mb})
class GPTDataParallel(GPT):
    pass


@mg.data_parallel(bucket_mb={bucket_mb}, sync_every=4)
class GPTLocalSGD4(GPT):
    pass


@mg.data_parallel(bucket_mb={bucket_mb})
class ConvNetDataParallel(ConvNet):
    pass


def adamw(params, fused=False):
    return mg.shard_optimizer(torch.optim.AdamW(params, lr=1e-4, fused=fused))
"""


def expanded_module(out_dir: Path):
    from macrogen.expand import expand_source

    path = out_dir / "bench_ddp_models.py"
    path.write_text(expand_source(SOURCE.format(bucket_mb=BUCKET_MB), path="bench/ddp.py").code)
    sys.path.insert(0, str(out_dir))
    import bench_ddp_models

    return bench_ddp_models


# (a point-to-point isend or irecv counts as one call: ZeRO-1 on gloo sends its buckets so)
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce_scatter_single",
    "all_gather_single",
    "isend",
    "irecv",
)


class CountCollectives:
    """Counts Python-level collective calls (DDP's reducer calls C++: counted from its hooks)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = {name: getattr(dist, name) for name in COLLECTIVES}

    def __enter__(self):
        def counting(fn):
            def wrapped(*args, **kwargs):
                self.calls += 1
                return fn(*args, **kwargs)

            return wrapped

        for name, fn in self._orig.items():
            setattr(dist, name, counting(fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


DDP_CALLS = [0]


def counting_allreduce_hook(state, bucket):
    """DDP's allreduce_hook, counted: on an untimed twin of the timed DDP model (same buckets)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    DDP_CALLS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


Variant = tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]]


def variants(models, rank: int) -> dict[str, Variant]:
    """name -> (model, optimizer, batch); every model of a kind starts from the same weights."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.gpt import GPT, GPTConfig, batch

    config = GPTConfig(**MODEL)
    tokens = batch(config, BATCH, seed=1 + rank)
    g = torch.Generator().manual_seed(rank)
    images = (
        torch.randn(IMAGES, 3, 32, 32, generator=g),
        torch.randint(0, 10, (IMAGES,), generator=g),
    )

    def fresh(cls):
        torch.manual_seed(0)
        return cls(config) if issubclass(cls, GPT) else cls()

    def plain(params, fused=False):
        return torch.optim.AdamW(params, lr=1e-4, fused=fused)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    out: dict[str, Variant] = {}
    m = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    out["ddp"] = (m, plain(m.parameters()), tokens)
    m = fresh(models.GPTDataParallel)
    out["macrogen"] = (m, plain(m.parameters()), tokens)
    m = fresh(models.GPTDataParallel)
    out["zero1"] = (m, models.adamw(m.parameters()), tokens)
    m = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    out["ddp_fused"] = (m, plain(m.parameters(), fused=True), tokens)
    m = fresh(models.GPTDataParallel)
    out["zero1_fused"] = (m, models.adamw(m.parameters(), fused=True), tokens)
    # clipped where DDP users clip: torch's clip_grad_norm_ of .grad after backward (under
    # ZeRO-1 the averaged gradients' norm, from the shares), or mg.clip_grad_norm_(opt, c)
    m = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    out["ddp_clip"] = (m, plain(m.parameters()), tokens)
    m = fresh(models.GPTDataParallel)
    out["zero1_clip"] = (m, models.adamw(m.parameters()), tokens)
    m = fresh(models.GPTDataParallel)
    out["zero1_mgclip"] = (m, models.adamw(m.parameters()), tokens)
    m = fresh(models.GPTLocalSGD4)
    out["sync4"] = (m, plain(m.parameters()), tokens)
    m = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    zero = ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4)
    out["ddp_zero"] = (m, zero, tokens)
    # ZeRO-1's floor: DDP (its collectives) with 1/world of the AdamW work, nothing else
    m = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    out["zero1_floor"] = (m, plain(first_elements(list(m.parameters()), 0.5)), tokens)
    m = DDP(fresh(models.ConvNet), bucket_cap_mb=BUCKET_MB)
    out["ddp_bn"] = (m, sgd(m.parameters()), images)
    m = fresh(models.ConvNetDataParallel)
    out["macrogen_bn"] = (m, sgd(m.parameters()), images)
    # any data-parallel scheme's floor: the conv net with no communication at all
    m = fresh(models.ConvNet)
    out["bn_floor"] = (m, sgd(m.parameters()), images)
    # ... plus one blocking all-reduce of as many bytes as its gradients, after backward
    m = fresh(models.ConvNet)
    out["bn_allreduce"] = (m, AllReduceFirst(sgd(m.parameters())), images)
    return out


MAX_NORM = 1.0  # nanoGPT's grad_clip (torchtitan's max_norm, HF Trainer's max_grad_norm)


def clip(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The clip a variant makes between backward and step (``*_clip``, ``*_mgclip``), if any."""
    if name.endswith("_mgclip"):
        import macrogen as mg

        mg.clip_grad_norm_(opt, MAX_NORM)
    elif name.endswith("_clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


class AllReduceFirst(torch.optim.Optimizer):
    """``optimizer``, after one all-reduce of a buffer the size of its gradients (a floor)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        numel = sum(p.numel() for g in self.param_groups for p in g["params"])
        self.buffer = torch.zeros(numel)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def step(self, closure=None):
        dist.all_reduce(self.buffer)
        return self.inner.step(closure)


def first_elements(params: list[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """The first parameters holding about ``fraction`` of the elements."""
    total, taken, out = sum(p.numel() for p in params), 0, []
    for p in params:
        if taken >= fraction * total:
            break
        out.append(p)
        taken += p.numel()
    return out


def ddp_calls_per_step(model: torch.nn.Module, batch) -> int:
    """All-reduce calls per step of DDP on this model (after DDP rebuilds its buckets)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    twin = DDP(model, bucket_cap_mb=BUCKET_MB)
    twin.register_comm_hook(None, counting_allreduce_hook)
    for _ in range(3):
        DDP_CALLS[0] = 0
        twin(*batch).backward()
    return DDP_CALLS[0]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Optimizer state this rank holds."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def setup(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def worker(rank: int, world: int, port: int, steps: int, rounds: int, out_dir: str) -> None:
    setup(rank, world, port)
    models = expanded_module(Path(out_dir))
    runs = variants(models, rank)
    times: dict[str, list[float]] = {n: [] for n in runs}
    cpu_times: dict[str, list[float]] = {n: [] for n in runs}
    calls: dict[str, int] = {}

    def step(name: str) -> None:
        model, opt, batch = runs[name]
        opt.zero_grad()
        model(*batch).backward()
        clip(name, model, opt)
        opt.step()

    def settle(name: str) -> None:
        """ZeRO-1: wait for the last step's all-gather (the next forward would overlap it)."""
        opt = runs[name][1]
        if hasattr(opt, "finish_gather"):
            opt.finish_gather()

    for name in runs:  # warm up, and count the collectives of one step (4 for local SGD)
        step(name)
        with CountCollectives() as count:
            for _ in range(4):
                step(name)
            settle(name)
        calls[name] = count.calls / 4
    from examples.gpt import GPT, GPTConfig

    gpt_batch, conv_batch = runs["ddp"][2], runs["ddp_bn"][2]
    ddp_calls = ddp_calls_per_step(GPT(GPTConfig(**MODEL)), gpt_batch)
    for name in ("ddp", "ddp_fused", "ddp_clip", "ddp_zero", "zero1_floor"):
        calls[name] += ddp_calls
    calls["ddp_bn"] += ddp_calls_per_step(models.ConvNet(), conv_batch)
    states = {name: state_bytes(opt) for name, (_, opt, _) in runs.items()}
    started = time.perf_counter()
    for _ in range(rounds):
        for name in runs:
            # ``steps`` steps in a row, timed together with the settling of the last one: the
            # all-gather of the others overlaps the next forward, as in a training loop, and
            # none leaks (its wait or its CPU) into the next variant's time
            dist.barrier()
            c, t = cpu_seconds(), time.perf_counter()
            for _ in range(steps):
                step(name)
            settle(name)
            times[name].append((time.perf_counter() - t) / steps)
            cpu_times[name].append((cpu_seconds() - c) / steps)
    if rank == 0:
        report(times, cpu_times, calls, states, time.perf_counter() - started)
    dist.barrier()
    dist.destroy_process_group()


# Functions whose time --profile reports (cumulative, per step), by (file suffix, name).
PROFILED = (
    ("module.py", "_wrapped_call_impl", "forward (model call, hooks included)"),
    ("_tensor.py", "backward", "backward (hooks, end-of-backward waits included)"),
    ("optimizer.py", "wrapper", "optimizer.step() (all optimizers, nested)"),
    ("buckets.py", "take", "@data_parallel Bucket.take (gradient into its bucket)"),
    ("buckets.py", "launch", "@data_parallel Bucket.launch"),
    ("buckets.py", "wait", "@data_parallel Bucket.wait"),
    ("data_parallel.py", "_after_backward", "@data_parallel end of backward (waits)"),
    ("data_parallel.py", "broadcast", "@data_parallel buffer broadcast"),
    ("zero_buckets.py", "launch_reduce", "ZeRO copy into send buffer + reduce-scatter launch"),
    ("zero_buckets.py", "finish_reduce", "ZeRO wait reduce-scatter + sum + scale"),
    ("zero.py", "_reduce_now", "ZeRO step's reduce (agreement all-reduce, waits, shares)"),
    ("zero_buckets.py", "refresh", "ZeRO parameters into the share"),
    ("zero_buckets.py", "launch_gather", "ZeRO all-gather launch"),
    ("zero_buckets.py", "finish_gather", "ZeRO wait all-gather + copy into parameters"),
    ("zero_guard.py", "wait_for", "ZeRO guard: checks (and waits) per torch op"),
    ("zero_grads.py", "route", "ZeRO: torch's clip of the sent .grads, on the shares"),
    ("adamw.py", "_multi_tensor_adamw", "AdamW foreach"),
    ("adamw.py", "_fused_adamw", "AdamW fused"),
)


def profile_worker(rank: int, world: int, port: int, steps: int, out_dir: str) -> None:
    """cProfile of ``steps`` steps of each variant on rank 0: where each one's time goes.

    The profiler's clock is the main thread's CPU time (``time.thread_time``): a
    function that waits for a collective shows what it computes, not how long
    the other rank or the machine's load kept it waiting (gloo's own threads are
    in the process's CPU time printed first, not in any function's)."""
    import cProfile
    import pstats

    setup(rank, world, port)
    models = expanded_module(Path(out_dir))
    runs = variants(models, rank)

    def step(name, model, opt, batch) -> None:
        opt.zero_grad()
        model(*batch).backward()
        clip(name, model, opt)
        opt.step()

    for name, (model, opt, batch) in runs.items():
        for _ in range(3):
            step(name, model, opt, batch)
        dist.barrier()
        prof = cProfile.Profile(time.thread_time)
        c, t = cpu_seconds(), time.perf_counter()
        prof.enable()
        for _ in range(steps):
            step(name, model, opt, batch)
        if hasattr(opt, "finish_gather"):
            opt.finish_gather()
        prof.disable()
        wall, cpu = (time.perf_counter() - t) / steps, (cpu_seconds() - c) / steps
        dist.barrier()
        if rank != 0:
            continue
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        print(f"{name}: {wall * 1e3:.1f} ms/step wall, {cpu * 1e3:.1f} ms CPU (all threads, under"
              " cProfile); main thread's CPU per step in:")  # fmt: skip
        for suffix, fn, what in PROFILED:
            cum = sum(v[3] for (f, _, n), v in stats.items() if n == fn and f.endswith(suffix))
            calls = sum(v[1] for (f, _, n), v in stats.items() if n == fn and f.endswith(suffix))
            if calls:
                print(
                    f"    {what:<55} {cum / steps * 1e3:7.2f} ms/step  ({calls / steps:.0f} calls)"
                )
    dist.barrier()
    dist.destroy_process_group()


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the compute thread and gloo's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def report(times, cpu_times, calls, states, seconds: float) -> None:
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    cpu = {n: statistics.median(t) * 1e3 for n, t in cpu_times.items()}
    n = len(next(iter(times.values())))
    print(f"GPT {MODEL}, batch {BATCH}x{MODEL['block_size']} tokens per rank, AdamW;")
    print(f"conv net with BatchNorm, {IMAGES} 3x32x32 images per rank, SGD; 2 gloo ranks")
    print(f"{n} rounds of timed steps per variant, interleaved; {seconds:.0f} s;"
          f" load average {os.getloadavg()}")  # fmt: skip
    print(f"{'variant':<12} {'median ms/step':>15} {'CPU ms/step':>12} {'collectives/step':>17} "
          f"{'optimizer state/rank':>21}")  # fmt: skip
    for v in times:
        state = f"{states[v] / 2**20:.1f} MiB" if states[v] else "-"
        print(f"{v:<12} {med[v]:>15.1f} {cpu[v]:>12.1f} {calls[v]:>17.2f} {state:>21}")
    print()
    for what, a, b, goal in (
        ("macrogen / DDP", "macrogen", "ddp", 0.85),
        ("ZeRO-1 / DDP (both AdamW)", "zero1", "ddp", 0.85),
        ("ZeRO-1 fused / DDP fused AdamW", "zero1_fused", "ddp_fused", 0.85),
        ("ZeRO-1 fused / DDP", "zero1_fused", "ddp", 0.85),
        ("ZeRO-1 + torch clip / DDP + torch clip", "zero1_clip", "ddp_clip", 0.85),
        ("ZeRO-1 + torch clip / ZeRO-1 + mg.clip", "zero1_clip", "zero1_mgclip", None),
        ("ZeRO-1 + torch clip / ZeRO-1 unclipped", "zero1_clip", "zero1", None),
        ("sync_every=4 / DDP", "sync4", "ddp", None),
        ("DDP + ZeroRedundancyOptimizer / DDP", "ddp_zero", "ddp", None),
        ("ZeRO-1 / DDP + ZeroRedundancyOptimizer", "zero1", "ddp_zero", None),
        ("conv+BN: macrogen / DDP", "macrogen_bn", "ddp_bn", 0.95),
        ("floor: DDP, AdamW on 1/world / DDP", "zero1_floor", "ddp", None),
        ("floor: conv+BN, no communication / DDP", "bn_floor", "ddp_bn", None),
        ("floor: conv+BN + 1 all-reduce / DDP", "bn_allreduce", "ddp_bn", None),
    ):
        goal_text = f"goal <= {goal}; " if goal else ""
        print(f"{what:<40} {med[a] / med[b]:.3f}  ({goal_text}CPU time {cpu[a] / cpu[b]:.3f})")
    print()
    full = states["ddp"]
    for v in ("zero1", "zero1_fused", "ddp_zero"):
        print(f"optimizer state per rank, {v} / DDP: {states[v] / full:.3f} (1/world = 0.5)")


# -- under torch.compile ------------------------------------------------------------------
def compile_worker(
    rank: int, world: int, port: int, steps: int, rounds: int, out_dir: str, backend: str
) -> None:
    """torch.compile(@data_parallel GPT) against torch.compile(DDP(GPT)), interleaved."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    setup(rank, world, port)
    from examples.gpt import GPT, GPTConfig, batch

    models = expanded_module(Path(out_dir))
    config = GPTConfig(**MODEL)
    tokens = batch(config, BATCH, seed=1 + rank)

    def fresh(cls):
        torch.manual_seed(0)
        return cls(config)

    ddp = DDP(fresh(GPT), bucket_cap_mb=BUCKET_MB)
    ours = fresh(models.GPTDataParallel)
    runs = {
        name: (torch.compile(m, backend=backend), torch.optim.AdamW(m.parameters(), lr=1e-4))
        for name, m in (("ddp", ddp), ("macrogen", ours))
    }
    losses: dict[str, list[float]] = {n: [] for n in runs}

    def step(name: str) -> None:
        model, opt = runs[name]
        opt.zero_grad()
        loss = model(*tokens)
        loss.backward()
        opt.step()
        losses[name].append(float(loss.detach()))

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    compiled, breaks, seconds = {}, {}, {}
    for name in runs:  # compile and warm up (recompilations, DDP's bucket rebuild) apart
        g, b, t = graphs(), sum(counters["graph_break"].values()), time.perf_counter()
        for _ in range(3):
            step(name)
        compiled[name], seconds[name] = graphs() - g, time.perf_counter() - t
        breaks[name] = sum(counters["graph_break"].values()) - b
    before = graphs()
    times: dict[str, list[float]] = {n: [] for n in runs}
    cpu_times: dict[str, list[float]] = {n: [] for n in runs}
    started = time.perf_counter()
    for _ in range(rounds):
        for name in runs:
            dist.barrier()
            c, t = cpu_seconds(), time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - t) / steps)
            cpu_times[name].append((cpu_seconds() - c) / steps)
    recompiled = graphs() - before
    if rank == 0:
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        cpu = {n: statistics.median(t) * 1e3 for n, t in cpu_times.items()}
        print(f"GPT {MODEL}, batch {BATCH}x{MODEL['block_size']} tokens per rank, AdamW;"
              f" torch.compile(backend={backend!r}); 2 gloo ranks, bucket {BUCKET_MB} MB")  # fmt: skip
        print(f"{rounds} rounds of {steps} timed steps per variant, interleaved;"
              f" {time.perf_counter() - started:.0f} s; load average {os.getloadavg()}")  # fmt: skip
        print(f"{'variant':<10} {'median ms/step':>15} {'CPU ms/step':>12} {'graphs':>7}"
              f" {'graph breaks':>13} {'compile+warm-up s':>18}")  # fmt: skip
        for n in runs:
            print(f"{n:<10} {med[n]:>15.1f} {cpu[n]:>12.1f} {compiled[n]:>7}"
                  f" {breaks[n]:>13} {seconds[n]:>18.1f}")  # fmt: skip
        print(f"graphs compiled during the timed rounds (recompilations): {recompiled}")
        first = [losses[n][0] for n in runs]
        last = [losses[n][-1] for n in runs]
        print(f"loss, first step: ddp {first[0]:.6f}, macrogen {first[1]:.6f};"
              f" after {len(losses['ddp'])} steps: ddp {last[0]:.6f}, macrogen {last[1]:.6f}")  # fmt: skip
        print()
        print(f"{'compiled: macrogen / DDP':<40} {med['macrogen'] / med['ddp']:.3f}"
              f"  (goal <= 1.0; CPU time {cpu['macrogen'] / cpu['ddp']:.3f})")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--curve", metavar="PNG", help="draw local SGD's loss curves instead")
    parser.add_argument("--curve-steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="cProfile each variant instead")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="@data_parallel + torch.compile vs DDP + torch.compile",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (--compile)")
    args = parser.parse_args()
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            mp.spawn(profile_worker, args=(2, port, 10, tmp), nprocs=2)
        elif args.compile:
            spawn_args = (2, port, args.steps, args.rounds, tmp, args.backend)
            mp.spawn(compile_worker, args=spawn_args, nprocs=2, join=True)
        elif args.curve:  # bench/local_sgd.py's loss runs, drawn
            sys.path.insert(0, str(ROOT))
            from bench.local_sgd import loss_worker

            png = str(Path(args.curve).resolve())
            mp.spawn(loss_worker, args=(2, port, args.curve_steps, tmp, png), nprocs=2)
        else:
            mp.spawn(worker, args=(2, port, args.steps, args.rounds, tmp), nprocs=2, join=True)


if __name__ == "__main__":
    main()
