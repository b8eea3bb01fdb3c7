"""``resumable`` with a model built on the meta device and given its values by ``init="model"``
(``tests/test_checkpoint_fsdp_dist.py``'s model, batches and checks).

Under FSDP on 2 gloo ranks: a run stopped at step 5 (checkpoint at 4) and resumed in fresh
objects (built on meta again) ends bit-identical to the uninterrupted run, and its step-4
checkpoint resumes on 4 ranks (DCP reshards), within fp32 rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn

from macrogen.runtime.checkpoint import resumable
from tests.distributed import run_ranks
from tests.test_checkpoint_fsdp_dist import EVERY, FP32, STEPS, STOP, Net, full


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    from macrogen.runtime.fully_sharded import FullyShardedConfig, apply_fully_sharded
    from macrogen.runtime.materialize import apply_init, check_init
    from macrogen.runtime.parallelize import device_mesh, parallelize_once

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    check_init(model, "model", where="t.py:1")
    parallelize_once(model, where="t.py:1")
    mesh = device_mesh(where="t.py:1")
    apply_fully_sharded(model, mesh, FullyShardedConfig(), where="t.py:1")
    apply_init(model, "model", where="t.py:1")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> torch.Tensor:
    """The step's global batch, drawn from the step alone: a rank the saving job did not have
    has no saved RNG state to draw it with (resumable restores each saved rank's own)."""
    from macrogen.runtime.mesh import mesh

    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step))
    m = mesh()
    return ids.chunk(m.data_size)[m.data_rank]


def train(ckpt: Path, stop: int | None = None, seed: int = 1) -> nn.Module:
    model, opt = build()
    torch.manual_seed(seed)  # (the batches do not draw from it)
    for step in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break
    return model


def stop_and_resume(rank: int, world: int, root: str) -> tuple[dict, dict]:
    whole = full(train(Path(root) / "whole"))
    train(Path(root) / "resumed", stop=STOP)
    resumed = full(train(Path(root) / "resumed", seed=2))
    return whole, resumed


def resume_elsewhere(rank: int, world: int, root: str) -> dict:
    return full(train(Path(root), seed=3))


def test_meta_built_fsdp_resumes_exactly_and_on_four_ranks(tmp_path: Path) -> None:
    whole, resumed = run_ranks(stop_and_resume, 2, args=(str(tmp_path),), timeout=300)[0]
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), f"{key} differs after stop and resume"
    four = tmp_path / "four"
    shutil.copytree(tmp_path / "whole" / "step_00000004", four / "step_00000004")
    on_four = run_ranks(resume_elsewhere, 4, args=(str(four),), timeout=300)[0]
    for key, value in whole.items():
        torch.testing.assert_close(on_four[key], value, **FP32, msg=key)
