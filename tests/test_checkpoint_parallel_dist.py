"""``resumable`` with macrogen's parallel kinds: tensor-parallel DTensors, ZeRO, TP with DP.

TP=2 and ZeRO on 2 gloo ranks, DP=2 x TP=2 on 4, averaged and with ZeRO-1 over the
DTensor shards (mg.parallelize's dp='zero1' with tp > 1; one spawn). For each: a run
stopped at step 5 (checkpoint at 4) and resumed in fresh objects ends
bit-identical to the uninterrupted 8-step run; the step-4
checkpoint resumed in one process on the serial model with the serial AdamW
ends equal to it within fp32 rounding (so every rank's shard was saved); and
for tensor parallelism the saved step-8 model is the serial model, bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from macrogen.runtime.checkpoint import resumable
from macrogen.runtime.checkpoint_convert import convert
from tests.distributed import run_ranks

STEPS, EVERY, STOP = 8, 4, 5
FP32 = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    """Every tensor-parallel style: vocab embedding, fused colwise (3 blocks), colwise, rowwise."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # this rank's columns of q, k and v
        x = x + self.proj(q * k + v)
        x = x + self.out(F.gelu(self.fc(self.ln(x))))
        return x.pow(2).mean()


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """kind: "tp" (TP=2), "zero" (DP=2, ZeRO-1), "dptp" (DP=2 x TP=2), "dptpzero" (DP=2 x TP=2,
    ZeRO-1 over the tensor shards), "serial"."""
    torch.manual_seed(0)
    model = Net()
    if kind in ("tp", "dptp", "dptpzero"):
        from macrogen.runtime.mesh import mesh
        from macrogen.runtime.parallelize import apply_tensor_parallel

        plan = {
            "emb": "vocab",
            "qkv": ("colwise", 3),
            "proj": "rowwise",
            "fc": "colwise",
            "out": "rowwise",
        }
        apply_tensor_parallel(model, mesh(2), plan, where="test_checkpoint_parallel_dist.py")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind in ("zero", "dptp", "dptpzero"):
        from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync
        from macrogen.runtime.mesh import mesh

        # data parallel over the data group (as dp="zero1" and dp="replicate" do)
        where = "test_checkpoint_parallel_dist.py"
        sync = GradientSync(model, DataParallelConfig(), where=where, mesh=mesh())
        model.__dict__["_mg_gradient_sync"] = sync
        if kind in ("zero", "dptpzero"):  # the sharded optimizer takes over: reduce-scatters
            from macrogen.runtime.zero import shard_optimizer

            opt = shard_optimizer(opt)
    return model, opt


def batch(kind: str) -> torch.Tensor:
    ids = torch.randint(0, 16, (4, 5))  # the global batch, drawn alike on every rank
    if kind in ("zero", "dptp", "dptpzero"):  # data parallel: this rank's share
        from macrogen.runtime.mesh import mesh

        return ids.chunk(mesh().data_size)[mesh().data_rank]
    return ids


def train(
    kind: str, ckpt: Path, rank: int, world: int, stop: int | None = None, seed: int = 1
) -> nn.Module:
    model, opt = build(kind)
    torch.manual_seed(seed)  # the data; a resumed run restores the saved RNG state
    for step in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(batch(kind)).backward()
        opt.step()
        opt.zero_grad()
        if step == stop:
            break  # the generator closes here and waits for the step-4 save
    return model


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    from macrogen.runtime.tensor_parallel import full_state_dict

    return full_state_dict(model)


def worker(rank: int, world: int, kinds: list[str], root: str) -> dict[str, tuple[dict, dict]]:
    out = {}
    for kind in kinds:  # (several kinds: one spawn)
        whole = full(train(kind, Path(root) / kind / "whole", rank, world))
        train(kind, Path(root) / kind / "resumed", rank, world, stop=STOP)
        resumed = full(train(kind, Path(root) / kind / "resumed", rank, world, seed=2))
        out[kind] = whole, resumed
    return out


def serial_resume(ckpt: Path) -> dict[str, torch.Tensor]:
    """The step-4 checkpoint resumed in this process on the serial model and AdamW."""
    model, opt = build("serial")
    for _ in resumable(range(STEPS), model=model, optimizer=opt, dir=ckpt, every=EVERY):
        model(torch.randint(0, 16, (4, 5))).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def check(kinds: list[str], tmp_path: Path, world: int = 2) -> None:
    results = run_ranks(worker, world_size=world, args=(kinds, str(tmp_path)), timeout=400)
    for kind in kinds:
        _check(kind, [r[kind] for r in results], tmp_path / kind)


def _check(kind: str, results: list[tuple[dict, dict]], tmp_path: Path) -> None:
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
    if kind != "zero":  # the saved model is the serial one, every rank's shard in place
        convert(tmp_path / "whole", tmp_path / "model.pt", model_only=True)
        saved = torch.load(tmp_path / "model.pt")
        assert saved.keys() == whole.keys()
        for key, value in whole.items():
            assert torch.equal(saved[key], value), key


def test_tensor_parallel_checkpoint_resumes_exactly_and_serially(tmp_path: Path) -> None:
    check(["tp"], tmp_path)


def test_zero_checkpoint_resumes_exactly_and_with_the_serial_optimizer(tmp_path: Path) -> None:
    check(["zero"], tmp_path)


def test_data_x_tensor_parallel_checkpoint_resumes_exactly_and_serially(
    tmp_path: Path,
) -> None:
    # tensor shards and data replicas at once: averaged, and with ZeRO-1 over the shards
    check(["dptp", "dptpzero"], tmp_path, world=4)
