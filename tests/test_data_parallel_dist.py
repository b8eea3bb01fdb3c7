"""@data_parallel on 2 gloo ranks: parameters after 5 steps equal the serial run and torch DDP.

One spawned run trains every model of ``tests/data_parallel_models.py`` (expanded)
three ways from the same start: serially on the whole batch, with torch DDP, and
data-parallel, and returns how far the parameters are apart (fp32: rtol 1e-5; bf16/fp16
compression: within half-precision tolerance), the all-reduce calls (one per bucket per
optimizer step) and the start-up broadcast's effect; a test per model asserts them.
A second run builds different models on the two ranks and expects the
rank-agreement error on both, within a bounded time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from macrogen.expand import expand_source
from macrogen.runtime.data_parallel import gradient_sync
from tests.dist_checks import closeness, each_rank, run_check
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
    """(For the other data-parallel tests, which import it.)"""
    for (name, a), (name_b, b) in zip(got.named_parameters(), want.named_parameters()):
        assert name == name_b, (what, name, name_b)
        if name in skip:
            continue
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{what}: {name}: {m}", **tol)


# Each GPT run: (class in data_parallel_models.py, micro-batches per step, tolerance,
# zero_grad's set_to_none); one test each, named as run_name names it.
GPT_RUNS = [
    ("Plain", 1, "fp32", True),
    ("Accumulating", 4, "fp32", True),
    ("ManyBuckets", 1, "fp32", True),
    # gradients stay the bucket views between steps: accumulated and scaled in place
    ("ManyBuckets", 2, "fp32", False),
    ("CompressedBF16", 1, "half", True),
    ("CompressedBF16", 2, "half", False),
    ("CompressedFP16", 1, "half", True),
]
TOLERANCES = {"fp32": dict(rtol=1e-5, atol=1e-6), "half": dict(rtol=2e-2, atol=2e-3)}


def run_name(cls: str, k: int, tol: str, set_to_none: bool) -> str:
    return f"{cls}(k={k}, set_to_none={set_to_none})"


def _gpt_run(models, config, inputs, rank: int, world: int, run: tuple) -> dict:
    """One GPT run three ways: serial, DDP and ours; the figures the parent asserts."""
    from examples.gpt import GPT

    cls_name, k, tol_name, set_to_none = run
    cls, tol = getattr(models, cls_name), TOLERANCES[tol_name]
    torch.manual_seed(0)
    serial = GPT(config)
    train(serial, micro_batches(inputs, k, 0, 1))

    torch.manual_seed(0)
    ddp_model = GPT(config)
    ddp = DDP(ddp_model)
    train(ddp, micro_batches(inputs, k, rank, world), ddp=ddp)

    torch.manual_seed(100 + rank)  # a different start on each rank: start-up broadcasts rank 0's
    if rank == 0:
        torch.manual_seed(0)
    ours = cls(config)
    with CountAllReduce() as count:
        train(ours, micro_batches(inputs, k, rank, world), set_to_none=set_to_none)
    sync = gradient_sync(ours)
    report = {
        "buckets": len(sync.buckets),
        "calls": count.calls,
        # one per bucket per optimizer step (Accumulating: per step; the others: per micro-batch)
        "expected calls": STEPS * len(sync.buckets) * (1 if cls_name == "Accumulating" else k),
        "same state_dict keys": list(ours.state_dict()) == list(serial.state_dict()),
        "gradients are bucket views": all(
            p.grad.data_ptr() == v.data_ptr()
            for b in sync.buckets
            for p, v in zip(b.params, b.views)
        ),
        "vs serial": closeness(ours, serial, **tol),
        "vs DDP": closeness(ours, ddp_model, **tol),
    }
    if cls_name == "Plain" and set_to_none:
        # .double() moves the parameters: buckets are planned again, in float64
        serial.double()
        ours.double()
        train(serial, micro_batches(inputs, k, 0, 1))
        train(ours, micro_batches(inputs, k, rank, world))
        report["after .double()"] = {
            "buffer dtype": str(sync.buckets[0].buffer.dtype),
            "vs serial": closeness(ours, serial, **TOLERANCES["fp32"]),
        }
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
    return {
        "vs DDP(find_unused_parameters=True)": closeness(
            ours, ref_model, skip=never, rtol=1e-5, atol=1e-6
        ),
        "unused parameters untouched": {
            name: torch.equal(ours.get_parameter(name), start[name]) for name in never
        },
        "unused parameters' gradients": {
            name: repr(ours.get_parameter(name).grad) for name in never
        },
        "b has a gradient": ours.b.weight.grad is not None,  # used on rank 0 only: averaged on both
        "seen": float(ours.seen),
        "buckets": len(gradient_sync(ours).buckets),
        "calls": count.calls,
    }


def _all_cases(rank: int, world: int, out_dir: str) -> dict:
    """Every check's figures (or its error), by name: one spawn for them all."""
    from examples.gpt import batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    report: dict = {}
    for run in GPT_RUNS:
        run_check(
            report,
            run_name(*run),
            lambda run=run: _gpt_run(models, config, inputs, rank, world, run),
        )
    run_check(report, "branchy", lambda: _branchy(rank, world, out_dir))
    return report


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("data_parallel")
    return run_ranks(_all_cases, 2, args=(str(out),), timeout=150)


@pytest.mark.parametrize("run", GPT_RUNS, ids=[run_name(*r) for r in GPT_RUNS])
def test_gpt_matches_serial_and_ddp(parity, run):
    name = run_name(*run)
    for rank, r in enumerate(each_rank(parity, name)):
        at = f"{name}, rank {rank}"
        assert r["calls"] == r["expected calls"], f"{at}: all-reduce calls ({r['buckets']} buckets)"
        assert r["same state_dict keys"], f"{at}: state_dict keys differ from the serial model's"
        assert r["gradients are bucket views"], f"{at}: a .grad is not its bucket's view"
        for ref in ("vs serial", "vs DDP"):
            worst, where = r[ref]
            assert worst <= 1, f"{at} {ref}: {where} off by {worst:.3g} x the tolerance"


def test_plain_after_double_plans_float64_buckets(parity):
    """.double() moves the parameters: buckets are planned again, in float64."""
    for rank, r in enumerate(each_rank(parity, run_name("Plain", 1, "fp32", True))):
        double = r["after .double()"]
        assert double["buffer dtype"] == "torch.float64", rank
        worst, where = double["vs serial"]
        assert worst <= 1, f"rank {rank}: {where} off by {worst:.3g} x the tolerance"


def test_bucket_counts_agree_across_ranks(parity):
    for run in GPT_RUNS:
        buckets = [r["buckets"] for r in each_rank(parity, run_name(*run))]
        assert buckets[0] == buckets[1], run_name(*run)
    plain, many = (
        each_rank(parity, run_name(c, 1, "fp32", True))[0] for c in ("Plain", "ManyBuckets")
    )
    assert plain["buckets"] == 1  # a tiny model fits in the first bucket (1 MiB)
    assert many["buckets"] >= 5


def test_branch_unused_on_one_rank_matches_ddp_find_unused(parity):
    results = each_rank(parity, "branchy")
    for rank, r in enumerate(results):
        worst, where = r["vs DDP(find_unused_parameters=True)"]
        assert worst <= 1, f"rank {rank}: {where} off by {worst:.3g} x the tolerance"
        assert all(r["unused parameters untouched"].values()), (
            rank,
            r["unused parameters untouched"],
        )
        assert set(r["unused parameters' gradients"].values()) == {"None"}, rank
        assert r["b has a gradient"], rank
        assert r["seen"] == STEPS, rank  # buffers broadcast from rank 0 before each forward
        assert r["buckets"] > 1 and r["calls"] == STEPS * r["buckets"], rank
    assert results[0] == results[1]


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


def _averaged_once_worker(rank: int, world: int) -> list:
    """Two backwards per step under averaged_once (a pipeline step's micro-batches), accumulate=2
    steps per window: the buckets go once per window, holding the mean of every rank's sums."""
    from macrogen.runtime import buckets
    from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync
    from macrogen.runtime.mesh import mesh

    launches = []
    launch = buckets.Bucket.launch
    buckets.Bucket.launch = lambda self, *a, **k: (launches.append(1), launch(self, *a, **k))[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sync = GradientSync(model, DataParallelConfig(accumulate=2), where="t.py:1", mesh=mesh())
    out = []
    for step in range(4):
        model(torch.zeros(1, 3))  # the first forward starts the averaging (buckets, broadcast)
        with sync.averaged_once():
            for micro in range(2):
                x = torch.full((1, 3), float(1 + rank + micro + step))
                model(x).sum().backward()
        out.append((len(launches), model.weight.grad.clone()))
        if step % 2 == 1:
            model.zero_grad()
    return out


def test_averaged_once_counts_a_step_s_backwards_as_one_and_averages_at_the_window_s_end():
    results = run_ranks(_averaged_once_worker, 2, timeout=60)
    for rank, out in enumerate(results):
        assert [n for n, _ in out] == [0, 1, 1, 2]  # windows of 2 steps, 2 backwards each
        for step in (1, 3):
            # d(sum(Wx + b))/dW = x per row: the window's x summed, averaged over the ranks
            total = sum(1 + r + m + s for r in range(2) for m in range(2) for s in (step - 1, step))
            torch.testing.assert_close(out[step][1], torch.full((2, 3), total / 2))
        local = sum(1 + rank + m for m in range(2))  # step 0: this rank's own, not sent yet
        torch.testing.assert_close(out[0][1], torch.full((2, 3), float(local)))
