"""@data_parallel(sync_every=k): periodic parameter averaging (local SGD) on 2 gloo ranks.

- k=1 averaging with plain SGD equals the serial run;
- k=4 equals torch's PeriodicModelAverager(period=4) on the same seeds and data;
- k=2 after 3 synchronous warm-up steps equals DDP's post-local-SGD hook +
  PeriodicModelAverager(period=2, warmup_steps=3) (PostLocalSGDOptimizer's schedule);
- the collectives per step drop k-fold (counted).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync, gradient_sync
from macrogen.runtime.local_sgd import LocalSGD
from macrogen.runtime.mesh import SERIAL
from tests.distributed import run_ranks
from tests.test_data_parallel_dist import (
    GLOBAL_BATCH,
    CountAllReduce,
    assert_params_close,
    expanded_models,
    micro_batches,
    tiny_config,
)

STEPS = 8
FP32 = dict(rtol=1e-5, atol=1e-6)


def sgd(model, momentum=0.0):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def train(model, opt, batch, averager=None):
    for _ in range(STEPS):
        opt.zero_grad()
        model(*batch).backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())


def _cases(rank: int, world: int, out_dir: str) -> dict:
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    mine = micro_batches(inputs, 1, rank, world)[0]
    report = {}

    # k = 1: averaging the parameters after every plain SGD step is the serial step
    torch.manual_seed(0)
    serial = GPT(config)
    train(serial, sgd(serial), inputs)
    torch.manual_seed(0)
    ours = models.Plain(config)
    sync = gradient_sync(ours)
    sync.local_sgd = LocalSGD(sync)  # sync_every=1 through the averaging path
    with CountAllReduce() as count:
        train(ours, sgd(ours), mine)
    assert_params_close(ours, serial, "parameter averaging every step vs serial", **FP32)
    report["k=1 calls"] = count.calls

    # k = 4 against torch's PeriodicModelAverager (each rank steps on its own gradients)
    torch.manual_seed(0)
    ref = GPT(config)
    train(ref, sgd(ref, 0.9), mine, PeriodicModelAverager(period=4, warmup_steps=0))
    torch.manual_seed(0)
    ours = models.LocalSGD4(config)
    with CountAllReduce() as count:
        train(ours, sgd(ours, 0.9), mine)
    assert_params_close(ours, ref, "sync_every=4 vs PeriodicModelAverager", **FP32)
    report["k=4 calls"] = count.calls
    report["k=4 averages"] = gradient_sync(ours).local_sgd.averages

    # k = 2 after 3 synchronous steps against DDP's post-local-SGD hook + the averager
    torch.manual_seed(0)
    ref_model = GPT(config)
    ddp = DDP(ref_model)
    alone, _ = dist.new_subgroups(group_size=1)  # after the warm-up: no gradient all-reduce
    state = post_local.PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=3)
    ddp.register_comm_hook(state, post_local.post_localSGD_hook)
    train(ddp, sgd(ref_model, 0.9), mine, PeriodicModelAverager(period=2, warmup_steps=3))
    torch.manual_seed(0)
    ours = models.LocalSGDWarm(config)
    train(ours, sgd(ours, 0.9), mine)
    assert_params_close(ours, ref_model, "sync_every=2 after 3 warm-up steps vs torch", **FP32)
    return report


def test_periodic_averaging_matches_serial_and_torch(tmp_path):
    results = run_ranks(_cases, 2, args=(str(tmp_path),), timeout=150)
    r = results[0]
    assert r["k=1 calls"] == STEPS  # one flat all-reduce of the parameters per step
    assert r["k=4 averages"] == 2  # after steps 0 and 4 (0-based), as PeriodicModelAverager
    assert r["k=4 calls"] == r["k=4 averages"]  # no gradient all-reduce in between


def test_serial_run_installs_no_averaging():
    model = torch.nn.Linear(2, 2)
    sync = GradientSync(model, DataParallelConfig(sync_every=4), where="t.py:1", mesh=SERIAL)
    assert sync.world_size == 1 and sync.local_sgd is not None
    opt = sgd(model)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert sync.local_sgd.steps == 0  # not started: nothing counted, nothing averaged
