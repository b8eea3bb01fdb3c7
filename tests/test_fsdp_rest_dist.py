"""FSDP for classes of the user's own, CPU offload, and kill-and-resume, on gloo ranks.

- ``@mg.data_parallel(shard="full")`` against the serial program after 5 AdamW steps
  on 2 ranks (1e-5 in fp32), and bitwise against ``mg.parallelize(dp="fsdp")`` on the
  same weights (the same apply);
- ``cpu_offload=True`` (parallelize's and the decorator's) against serial;
- a rank SIGKILLed under ``torchrun --max-restarts=1`` with FSDP on 2 ranks: the job
  resumes from its last checkpoint and ends bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks, run_script
from tests.helpers import expand, load_module

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 2 * dim)
            self.proj = nn.Linear(2 * dim, dim)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.ln(x))))


    class Net(nn.Module):
        def __init__(self, dim=16, layers=3):
            super().__init__()
            self.emb = nn.Embedding(32, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
            self.head = nn.Linear(dim, 32)

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


    @mg.data_parallel(shard="full")
    class Full(Net):
        pass


    @mg.data_parallel(shard="full", cpu_offload=True, reshard_after_forward=False)
    class Offloaded(Net):
        pass


    def fsdp(model):
        return mg.parallelize(model, dp="fsdp")


    def fsdp_offload(model):
        return mg.parallelize(model, dp="fsdp", cpu_offload=True)
    """
)

STEPS, BATCH, SEQ = 5, 4, 6


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rows):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (BATCH, SEQ), generator=gen)[rows]
        model(ids).backward()
        opt.step()
        opt.zero_grad()
    return {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def _parity(rank, world, tmp, build):
    import torch.distributed as dist

    import macrogen as mg

    module = load_module(expand(SOURCE), f"fsdp_rest_{build}_{rank}", Path(tmp))
    torch.manual_seed(0)
    ref = _train(module.Net(), slice(None))
    torch.manual_seed(0)
    if build in ("Full", "Offloaded"):
        model = getattr(module, build)()
    else:
        model = getattr(module, build)(module.Net())
    data = mg.mesh(model)  # the mesh it was sharded on
    share = BATCH // data.data_size
    rows = slice(data.data_rank * share, (data.data_rank + 1) * share)
    sharded = [type(p).__name__ for p in model.parameters()]
    assert set(sharded) == {"DTensor"}, sharded
    offloaded = {p.device.type for p in model.parameters()}
    ours = _train(model, rows)
    assert ours.keys() == ref.keys()  # the serial model's names
    for key, value in ref.items():
        torch.testing.assert_close(
            ours[key], value, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    if build == "Full":  # mg.parallelize's dp="fsdp" on the same weights: the same bits
        torch.manual_seed(0)
        theirs = _train(module.fsdp(module.Net()), rows)
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), key
    dist.barrier()
    return type(model).__name__, offloaded


def test_data_parallel_shard_full_matches_serial(tmp_path):
    results = run_ranks(_parity, 2, args=(str(tmp_path), "Full"), timeout=300)
    assert [name for name, _ in results] == ["FSDPFull", "FSDPFull"]  # fully_shard's class


@pytest.mark.parametrize("build", ["fsdp_offload", "Offloaded"])
def test_cpu_offload_matches_serial(tmp_path, build):
    results = run_ranks(_parity, 2, args=(str(tmp_path), build), timeout=300)
    assert all(devices == {"cpu"} for _, devices in results)


# -- kill and resume under torchrun ----------------------------------------------------------

SCRIPT = Path(__file__).with_name("fsdp_kill_train.py")
TIMEOUT = 300  # seconds per launch


def _launch(tmp: Path, name: str, *extra: str) -> dict:
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.1", str(SCRIPT),
           "--dir", str(tmp / name), "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


@pytest.mark.timeout(700)
def test_fsdp_killed_rank_resumes_bit_identical(tmp_path: Path) -> None:
    # the uninterrupted run on forked ranks: what torchrun's one attempt runs, without its start-up
    whole_args = ["--dir", str(tmp_path / "whole"), "--out", str(tmp_path / "whole.pt")]
    env = {"CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
    run_script(str(SCRIPT), whole_args, 2, env=env, timeout=TIMEOUT)
    whole = torch.load(tmp_path / "whole.pt")
    killed = _launch(tmp_path, "killed", "--kill", "1:6")  # checkpoint at step 4, killed at 6
    assert int(whole.pop("_restarts")) == 0 and int(killed.pop("_restarts")) == 1
    assert whole.keys() == killed.keys()
    for key, value in whole.items():
        assert torch.equal(killed[key], value), f"{key} differs after kill and resume"


# -- FSDP + pipeline: each stage sharded within its data group --------------------------------

PIPELINED = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 2 * dim)
            self.proj = nn.Linear(2 * dim, dim)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.ln(x))))


    @mg.data_parallel(shard="full")
    @mg.pipeline(stages=2, microbatches=2, schedule="1f1b", split=["blocks.2"])
    class Net(nn.Module):
        def __init__(self, dim=16, layers=4):
            super().__init__()
            self.emb = nn.Embedding(32, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
            self.head = nn.Linear(dim, 32)

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    def loss_fn(logits, ids):
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    """
)


def _train_pipelined(module, rows):
    import macrogen as mg

    torch.manual_seed(0)
    model = module.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (2 * BATCH, SEQ), generator=gen)[rows]
        mg.pipeline_step(model, ids, ids, module.loss_fn)
        opt.step()
        opt.zero_grad()
    return model


def _pipelined(rank, world, tmp, expanded):
    from macrogen.runtime import mesh as meshes
    from macrogen.runtime import pipeline as rp

    module = load_module(expanded, f"fsdp_pipe_{rank}", Path(tmp))
    pipe = None
    rows = slice(None)
    lay = meshes.mesh(pipeline=2)  # (the program's: the pipelined model's, made first)
    if lay is not None and lay.data_size > 1:
        share = 2 * BATCH // lay.data_size
        rows = slice(lay.data_rank * share, (lay.data_rank + 1) * share)
    model = _train_pipelined(module, rows)
    pipe = rp.pipeline_of(model)
    kinds = {type(p).__name__ for p in model.parameters()}
    full = {k: v.detach().clone() for k, v in model.full_state_dict().items()}
    with torch.no_grad():  # a reload puts each shard back
        for p in model.parameters():
            p.add_(1.0)
    model.load_full_state_dict(full)
    reloaded = model.full_state_dict()
    assert all(torch.equal(reloaded[k], full[k]) for k in full)
    return full, kinds, pipe.fully_sharded


def test_fsdp_of_a_pipeline_model_matches_serial(tmp_path):
    import macrogen as mg

    serial_module = load_module(PIPELINED, "fsdp_pipe_serial", tmp_path)
    ref = {
        k: v.detach().clone()
        for k, v in _train_pipelined(serial_module, slice(None)).state_dict().items()
    }
    expanded = mg.expand_source(PIPELINED, path="pipelined.py").code
    results = run_ranks(_pipelined, 4, args=(str(tmp_path), expanded), timeout=400)
    for full, kinds, sharded in results:
        assert sharded and kinds == {"DTensor"}, kinds
        assert list(full) == list(ref)
        for key, value in ref.items():
            torch.testing.assert_close(
                full[key], value, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
            )
