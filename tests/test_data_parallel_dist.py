"""@data_parallel on 2 gloo ranks: parameters after 5 steps equal the serial run and torch DDP.

One spawned run trains every model of ``tests/data_parallel_models.py`` (expanded)
three ways from the same start: serially on the whole batch, with torch DDP, and
data-parallel, and compares the parameters (fp32: rtol 1e-5; bf16/fp16
compression: within half-precision tolerance). It also counts the all-reduce
calls (one per bucket per optimizer step) and checks the start-up broadcast.
A second run builds different models on the two ranks and expects the
rank-agreement error on both, within a bounded time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from macrogen.expand import expand_source
from macrogen.runtime.data_parallel import gradient_sync
from tests.distributed import run_ranks
from tests.helpers import load_module

MODELS = Path(__file__).parent / "data_parallel_models.py"
STEPS = 5
GLOBAL_BATCH = 8


def expanded_models(out_dir: str, rank: int):
    code = expand_source(MODELS.read_text(), path="tests/data_parallel_models.py").code
    return load_module(code, f"data_parallel_models_rank{rank}", Path(out_dir))


def serial_class(models, name: str) -> type:
    """The user's class, unexpanded (the expansion keeps the class itself: it has no serial base)."""
    directory = Path(models.__file__).parent
    serial = load_module(MODELS.read_text(), f"{models.__name__}_serial", directory)
    return getattr(serial, name)


def tiny_config(**changes):
    from examples.gpt import GPTConfig

    sizes = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    return GPTConfig(**{**sizes, **changes})


def optimizer(model):
    # weight decay and momentum: a None gradient (skipped) and a zero one (decayed) differ
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def micro_batches(inputs, k: int, rank: int, world: int):
    """k micro-batches of this rank's rows (world=1: all rows)."""
    share = inputs[0].shape[0] // world
    mine = [t[rank * share : (rank + 1) * share] for t in inputs]
    return list(zip(*(t.chunk(k) for t in mine)))


def train(model, batches, *, ddp: DDP | None = None, set_to_none: bool = True):
    """STEPS optimizer steps; each averages len(batches) micro-batches (loss / k per micro-batch)."""
    opt = optimizer(model)
    k = len(batches)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        for j, mb in enumerate(batches):
            if ddp is not None and j < k - 1:
                with ddp.no_sync():
                    (model(*mb) / k).backward()
            else:
                (model(*mb) / k).backward()
        opt.step()


class CountAllReduce:
    def __init__(self):
        self.calls = 0
        self.sizes: list[int] = []  # elements of each all-reduced tensor

    def __enter__(self):
        self._orig = dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            self.sizes.append(args[0].numel())
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def assert_params_close(got, want, what: str, skip=(), **tol) -> None:
    for (name, a), (name_b, b) in zip(got.named_parameters(), want.named_parameters()):
        assert name == name_b, (what, name, name_b)
        if name in skip:
            continue
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{what}: {name}: {m}", **tol)


def _gpt_cases(rank: int, world: int, out_dir: str) -> dict:
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    fp32 = dict(rtol=1e-5, atol=1e-6)
    half = dict(rtol=2e-2, atol=2e-3)
    report = {}
    for cls, k, tol, set_to_none in (
        (models.Plain, 1, fp32, True),
        (models.Accumulating, 4, fp32, True),
        (models.ManyBuckets, 1, fp32, True),
        # gradients stay the bucket views between steps: accumulated and scaled in place
        (models.ManyBuckets, 2, fp32, False),
        (models.CompressedBF16, 1, half, True),
        (models.CompressedBF16, 2, half, False),
        (models.CompressedFP16, 1, half, True),
    ):
        torch.manual_seed(0)
        serial = GPT(config)
        train(serial, micro_batches(inputs, k, 0, 1))

        torch.manual_seed(0)
        ddp_model = GPT(config)
        ddp = DDP(ddp_model)
        train(ddp, micro_batches(inputs, k, rank, world), ddp=ddp)

        torch.manual_seed(
            100 + rank
        )  # a different start on each rank: start-up broadcasts rank 0's
        if rank == 0:
            torch.manual_seed(0)
        ours = cls(config)
        with CountAllReduce() as count:
            train(ours, micro_batches(inputs, k, rank, world), set_to_none=set_to_none)
        sync = gradient_sync(ours)
        name = f"{cls.__name__}(k={k}, set_to_none={set_to_none})"
        calls = STEPS * len(sync.buckets) * (1 if cls is models.Accumulating else k)
        assert count.calls == calls, (name, count.calls, len(sync.buckets))
        assert list(ours.state_dict()) == list(serial.state_dict()), name
        assert all(
            p.grad.data_ptr() == v.data_ptr()
            for b in sync.buckets
            for p, v in zip(b.params, b.views)
        )
        assert_params_close(ours, serial, f"{name} vs serial", **tol)
        assert_params_close(ours, ddp_model, f"{name} vs DDP", **tol)
        report[cls.__name__] = len(sync.buckets)
        if cls is models.Plain and set_to_none:
            # .double() moves the parameters: buckets are planned again, in float64
            serial.double()
            ours.double()
            train(serial, micro_batches(inputs, k, 0, 1))
            train(ours, micro_batches(inputs, k, rank, world))
            assert sync.buckets[0].buffer.dtype == torch.float64
            assert_params_close(ours, serial, "Plain after .double()", **fp32)
    return report


def _branchy(rank: int, world: int, out_dir: str) -> dict:
    models = expanded_models(out_dir, rank)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    x[0, 0], x[GLOBAL_BATCH // 2, 0] = 1.0, -1.0  # rank 0 runs b, rank 1 doesn't
    mine = x[rank * 4 : (rank + 1) * 4]

    torch.manual_seed(0)
    ours = models.Branchy()
    start = copy.deepcopy(ours.state_dict())
    if rank == 1:
        ours.seen.fill_(-5.0)  # buffers come from rank 0 before each forward
    ref_model = serial_class(models, "Branchy")()  # the user's class: a plain module for DDP
    ref_model.load_state_dict(ours.state_dict())
    ref = DDP(ref_model, find_unused_parameters=True)
    with CountAllReduce() as count:
        train(ours, [(mine,)])
    train(ref, [(mine,)], ddp=ref)

    # DDP hands a parameter no rank used a zero gradient, so weight decay moves it;
    # the serial program leaves its gradient None and the parameter untouched, as do we.
    never = ("never.weight", "never.bias")
    what = "Branchy vs DDP(find_unused_parameters=True)"
    assert_params_close(ours, ref_model, what, skip=never, rtol=1e-5, atol=1e-6)
    for name in never:
        assert torch.equal(ours.get_parameter(name), start[name]), name
        assert ours.get_parameter(name).grad is None, name
    assert ours.b.weight.grad is not None  # used on rank 0 only: averaged on both
    assert float(ours.seen) == STEPS
    return {"buckets": len(gradient_sync(ours).buckets), "calls": count.calls}


def _all_cases(rank: int, world: int, out_dir: str) -> dict:
    return {"gpt": _gpt_cases(rank, world, out_dir), "branchy": _branchy(rank, world, out_dir)}


def test_parity_with_serial_and_ddp(tmp_path):
    results = run_ranks(_all_cases, 2, args=(str(tmp_path),), timeout=150)
    assert results[0] == results[1]
    buckets = results[0]["gpt"]
    assert buckets["Plain"] == 1  # a tiny model fits in the first bucket (1 MiB)
    assert buckets["ManyBuckets"] >= 5
    branchy = results[0]["branchy"]
    assert branchy["buckets"] > 1 and branchy["calls"] == STEPS * branchy["buckets"]


def _mismatch(rank: int, world: int, out_dir: str) -> str:
    from macrogen.runtime.agreement import RankMismatchError

    models = expanded_models(out_dir, rank)
    config = tiny_config() if rank == 0 else tiny_config(n_layer=2)
    model = models.Plain(config)
    idx = torch.zeros(1, 8, dtype=torch.long)
    try:
        model(idx, idx)
    except RankMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_models_fail_clearly_on_every_rank(tmp_path):
    messages = run_ranks(_mismatch, 2, args=(str(tmp_path),), timeout=60)
    for rank, message in enumerate(messages):
        assert message.startswith(
            "data_parallel at tests/data_parallel_models.py:14: rank 1 built a"
        ), message
        assert "'blocks.1.ln_1.weight'" in message or "'blocks.0.ln_1.weight'" in message, message
        assert f"raised on rank {rank}" in message
