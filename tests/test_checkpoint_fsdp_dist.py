"""``resumable`` with ``mg.parallelize``'s models: FSDP, FSDP x TP and DTensor tensor parallel.

FSDP on 2 and on 4 gloo ranks, TP=2 (packed qkv included), and FSDP x TP 2 x 2 on 4
ranks (the packed qkv's nested strided placements, gathered by hand), and HSDP 2 x 2.
For each: a run stopped at step 5 (checkpoint at 4) and resumed in fresh objects ends
bit-identical to the uninterrupted 8-step run (DCP's ``get_state_dict`` /
``set_state_dict``: each rank saves and loads its own shards, nothing gathered to
one rank); the step-4 checkpoint resumed in one process on the serial model and
AdamW ends equal to it within fp32 rounding; and FSDP's 4-rank checkpoint resumes
on 2 ranks (DCP reshards).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn

from macrogen.runtime.checkpoint import resumable
from tests.distributed import run_ranks

STEPS, EVERY, STOP = 8, 4, 5
FP32 = dict(rtol=1e-5, atol=1e-6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)  # this rank's columns of q, k and v
        return x + self.proj(q * k + v)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


PLAN = {"blocks.*.qkv": ("colwise", 3), "blocks.*.proj": "rowwise"}


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """kind: "fsdp", "fsdptp" (FSDP x TP), "hsdp" (2 x 2), "tp" (DTensor TP), "serial"."""
    torch.manual_seed(0)
    model = Net()
    if kind != "serial":
        from macrogen.runtime.fully_sharded import FullyShardedConfig, apply_fully_sharded
        from macrogen.runtime.parallelize import apply_tensor_parallel, device_mesh

        tp = 2 if kind in ("fsdptp", "tp") else 1
        mesh = device_mesh(tp=tp, planned=tp > 1, where="t.py:1")
        if tp > 1:
            apply_tensor_parallel(model, mesh, PLAN, where="t.py:1")
        if kind.startswith("fsdp") or kind == "hsdp":
            config = FullyShardedConfig(dp_replicate=2 if kind == "hsdp" else 1)
            apply_fully_sharded(model, mesh, config, where="t.py:1")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch() -> torch.Tensor:
    from macrogen.runtime.mesh import mesh

    ids = torch.randint(0, 16, (4, 5))  # the global batch, drawn alike on every rank
    m = mesh()
    return ids.chunk(m.data_size)[m.data_rank]


def train(kind: str, ckpt: Path, stop: int | None = None, seed: int = 1) -> nn.Module:
    model, opt = build(kind)
    torch.manual_seed(seed)  # the data; a resumed run restores the saved RNG state
    for step in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(batch()).backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break  # the generator closes here and waits for the step-4 save
    return model


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    # (not DTensor.full_tensor(): FSDP x TP's packed qkv comes out of it with rows permuted)
    from macrogen.runtime.dtensor_whole import full_tensor

    return {
        k: (full_tensor(v) if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def worker(rank: int, world: int, kind: str, root: str) -> tuple[dict, dict]:
    whole = full(train(kind, Path(root) / "whole"))
    train(kind, Path(root) / "resumed", stop=STOP)
    resumed = full(train(kind, Path(root) / "resumed", seed=2))
    return whole, resumed


def resume_elsewhere(rank: int, world: int, kind: str, root: str) -> dict:
    return full(train(kind, Path(root), seed=3))


def serial_resume(ckpt: Path) -> dict[str, torch.Tensor]:
    """The step-4 checkpoint resumed in this process on the serial model and AdamW."""
    model, opt = build("serial")
    for _ in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(torch.randint(0, 16, (4, 5))).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def check(kind: str, tmp_path: Path, world: int = 2) -> dict:
    results = run_ranks(worker, world_size=world, args=(kind, str(tmp_path)), timeout=400)
    whole, resumed = results[0]
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), f"{kind}: {key} differs after stop and resume"
        for other in results[1:]:
            assert torch.equal(other[0][key], value), key  # the ranks agree
    one = tmp_path / "serial"
    shutil.copytree(tmp_path / "whole" / "step_00000004", one / "step_00000004")
    serial = serial_resume(one)
    for key, value in whole.items():
        torch.testing.assert_close(serial[key], value, **FP32, msg=f"{kind}: {key}")
    return whole


def test_fsdp_checkpoint_resumes_exactly_and_serially(tmp_path: Path) -> None:
    check("fsdp", tmp_path)


def test_fsdp_on_four_ranks_resumes_on_two(tmp_path: Path) -> None:
    whole = check("fsdp", tmp_path, world=4)
    two = tmp_path / "two"
    shutil.copytree(tmp_path / "whole" / "step_00000004", two / "step_00000004")
    (resumed, _) = run_ranks(resume_elsewhere, 2, args=("fsdp", str(two)), timeout=300)
    for key, value in whole.items():
        torch.testing.assert_close(resumed[key], value, **FP32, msg=key)


def test_fsdp_x_tensor_parallel_checkpoint_resumes_exactly_and_serially(tmp_path: Path) -> None:
    check("fsdptp", tmp_path, world=4)


def test_hsdp_checkpoint_resumes_exactly_and_serially(tmp_path: Path) -> None:
    check("hsdp", tmp_path, world=4)  # (replicate, shard) DTensors: 2-D, as FSDP x TP's


def test_dtensor_tensor_parallel_checkpoint(tmp_path: Path) -> None:
    check("tp", tmp_path)
