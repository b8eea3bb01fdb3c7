"""@data_parallel as DDP users use it, on 2 gloo ranks, against the serial program.

- a parameter replaced after construction (nanoGPT's crop_block_size) is averaged;
- ``clip_grad_norm_`` after backward clips the averaged gradients;
- ``torch.autocast`` with bf16 on CPU;
- ``model.eval()`` + ``torch.no_grad()`` inference on rank 0 only takes part in no collective;
- a forward that differs per rank (unused parameters differing per rank) is in
  tests/test_data_parallel_dist.py (``Branchy``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from macrogen.runtime.data_parallel import gradient_sync
from tests.distributed import run_ranks
from tests.test_data_parallel_dist import (
    GLOBAL_BATCH,
    CountAllReduce,
    assert_params_close,
    expanded_models,
    micro_batches,
    serial_class,
    tiny_config,
)

FP32 = dict(rtol=1e-5, atol=1e-6)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _train(model, batch, steps, *, clip=None, autocast=False):
    opt = _sgd(model)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(*batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def _replaced(models, rank, world) -> dict:
    """``m.w = nn.Parameter(...)`` before the first forward, and again after training began."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    (mine,) = micro_batches((x,), 1, rank, world)[0]

    def replace(model, seed):
        torch.manual_seed(seed)
        model.w = nn.Parameter(torch.randn(8, 8) * 0.5)

    out = {}
    for when in ("before first forward", "after 2 steps"):
        torch.manual_seed(0)
        serial = serial_class(models, "Replaceable")()  # the user's class, unexpanded
        torch.manual_seed(0)
        ours = models.Replaceable()
        if when == "before first forward":
            replace(serial, 1)
            replace(ours, 1)
        else:
            _train(serial, (x,), 2)
            _train(ours, (mine,), 2)
            replace(serial, 1)
            replace(ours, 1)
        _train(serial, (x,), 3)
        _train(ours, (mine,), 3)
        assert_params_close(ours, serial, f"replaced {when}", **FP32)
        sync = gradient_sync(ours)
        assert any(p is ours.w for p in sync.params), when
        if when == "after 2 steps":
            assert sync.replanned == ["'w' was replaced, removed or frozen"], sync.replanned
        out[when] = len(sync.params)
    return out


def _clip_and_autocast(models, rank, world) -> dict:
    from examples.gpt import GPT, batch

    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    mine = micro_batches(inputs, 1, rank, world)[0]
    for what, kwargs, tol in (
        ("clip_grad_norm_", dict(clip=0.05), FP32),
        ("autocast bf16", dict(autocast=True), dict(rtol=2e-2, atol=2e-3)),
    ):
        torch.manual_seed(0)
        serial = GPT(config)
        _train(serial, inputs, 3, **kwargs)
        torch.manual_seed(0)
        ours = models.Plain(config)
        _train(ours, mine, 3, **kwargs)
        assert_params_close(ours, serial, what, **tol)
    return {"ok": True}


def _inference_on_rank0(models, rank, world) -> dict:
    """nanoGPT's estimate_loss runs on the master process only, before and during training."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    (mine,) = micro_batches((x,), 1, rank, world)[0]
    torch.manual_seed(0)
    ref_model = serial_class(models, "WithBatchNorm")()
    ref = DDP(ref_model)  # BatchNorm on each rank's half batch: DDP is the reference here
    torch.manual_seed(0)
    ours = models.WithBatchNorm()

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            loss = model(x)
        model.train()
        return float(loss)

    results = []
    with CountAllReduce() as count:
        for step in range(3):
            if rank == 0:  # the other rank goes straight on to train: no collective may wait
                results.append(evaluate(ours))
                assert abs(results[-1] - evaluate(ref_model)) < 1e-5, step
            for model in (ref, ours):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                opt.zero_grad()
                model(mine).backward()
                opt.step()
    assert count.calls == 3 * len(gradient_sync(ours).buckets)
    for (n, a), (_, b) in zip(ours.state_dict().items(), ref_model.state_dict().items()):
        # bit for bit: the buffers (one byte-wise broadcast of rank 0's) and the parameters
        assert torch.equal(a, b), n
    return {"evaluated": len(results)}


def _all(rank: int, world: int, out_dir: str) -> dict:
    models = expanded_models(out_dir, rank)
    return {
        "replaced": _replaced(models, rank, world),
        "clip": _clip_and_autocast(models, rank, world),
        "inference": _inference_on_rank0(models, rank, world),
    }


def test_replaced_parameters_clip_autocast_and_inference(tmp_path):
    results = run_ranks(_all, 2, args=(str(tmp_path),), timeout=150)
    assert results[0]["replaced"] == {"before first forward": 3, "after 2 steps": 3}
    assert results[0]["inference"] == {"evaluated": 3}
    assert results[1]["inference"] == {"evaluated": 0}


def test_the_parameter_check_names_what_changed():
    from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync
    from macrogen.runtime.mesh import SERIAL

    net = nn.Sequential(nn.Linear(2, 2))
    sync = GradientSync(net, DataParallelConfig(), where="t.py:1", mesh=SERIAL)
    assert sync.params_changed() is None
    net[0].weight = nn.Parameter(torch.zeros(2, 2))
    assert sync.params_changed() == "'0.weight' was replaced, removed or frozen"
    sync._collect()
    net.add_module("1", nn.Linear(2, 2))
    assert sync.params_changed() == "'1.weight' is new"
    sync._collect()
    net[1].bias.requires_grad_(False)  # frozen: no longer averaged
    assert sync.params_changed() == "'1.bias' was replaced, removed or frozen"
