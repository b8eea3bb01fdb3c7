"""ZeRO-1's flat runs (macrogen.runtime.zero_runs) step exactly as one piece per parameter.

On 2 gloo ranks, two copies of a small model, each with a ShardedOptimizer:
one steps its share as flat runs (the default for torch's element-wise
optimizers), the other one piece per parameter (flat runs switched off).
Parameters and the state_dict must agree bit for bit after every step (to
rounding for torch's fused AdamW, which rounds by position), with
a parameter no rank ever uses, one that stops being used halfway (its run is
split), nanoGPT's two parameter groups (runs end where the group changes), and
a state_dict loaded into a fresh optimizer (flat where the pieces agree).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from macrogen.runtime import zero_runs
from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync
from macrogen.runtime.mesh import mesh
from macrogen.runtime.zero import ShardedOptimizer
from tests.distributed import run_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(13, 37), nn.LayerNorm(37), nn.GELU(), nn.Linear(37, 29), nn.LayerNorm(29)
        )
        self.late = nn.Linear(29, 5)  # used for the first steps only
        self.never = nn.Linear(29, 3)  # no rank ever uses it: its gradient stays None
        self.head = nn.Linear(29, 7)

    def forward(self, x, use_late: bool):
        h = self.layers(x)
        out = self.head(h).square().mean()
        return out + self.late(h).mean() if use_late else out


def one_group(model):
    return [{"params": list(model.parameters())}]


def nanogpt_groups(model):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95)),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5, centered=True),
    # torch's CPU fused kernel rounds by position (its vector body vs. its tail): a run and
    # its pieces agree to rounding only, as the pieces and the serial parameters do
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
}
ROUNDING = dict(rtol=1e-5, atol=1e-6)


def data_parallel(model: nn.Module) -> nn.Module:
    """``model`` averaged over the ranks, as mg.parallelize(dp="zero1") leaves it."""
    sync = GradientSync(model, DataParallelConfig(), where="test_zero_runs_dist.py", mesh=mesh())
    model.__dict__["_mg_gradient_sync"] = sync
    return model


def sharded(model, make, groups, *, flat: bool) -> ShardedOptimizer:
    saved = zero_runs.FLAT_SAFE
    if not flat:
        zero_runs.FLAT_SAFE = frozenset()
    try:
        # small buckets: several buckets, pieces cut mid-parameter
        return ShardedOptimizer(make(groups(model)), bucket_mb=0.005, first_bucket_mb=0.001)
    finally:
        zero_runs.FLAT_SAFE = saved


def assert_same(a: nn.Module, b: nn.Module, opt_a, opt_b, what: str, exact: bool) -> None:
    def same(x, y) -> bool:
        if exact or not torch.is_tensor(x) or not x.is_floating_point():
            return torch.equal(x, y) if torch.is_tensor(x) else x == y
        torch.testing.assert_close(x, y, **ROUNDING)
        return True

    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert same(p, q), f"{what}: {name} differs"
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"], what
    assert sorted(sa["state"]) == sorted(sb["state"]), what
    for i, state in sb["state"].items():
        for key, value in state.items():
            assert same(sa["state"][i][key], value), f"{what}: state {i} {key} differs"


def _flat_vs_pieces(rank: int, world: int, opt_name: str, groups_name: str) -> dict:
    make, groups = OPTIMIZERS[opt_name], {"one": one_group, "nanogpt": nanogpt_groups}[groups_name]
    exact = "fused" not in opt_name
    torch.manual_seed(0)
    flat_model = data_parallel(Net())
    torch.manual_seed(0)
    piece_model = data_parallel(Net())
    flat = sharded(flat_model, make, groups, flat=True)
    pieces = sharded(piece_model, make, groups, flat=False)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    runs_before = sum(run.flat for run in flat.runs)

    def step(model, opt, x, use_late):
        opt.zero_grad()
        model(x, use_late).backward()
        opt.step()

    for k in range(6):
        x = torch.randn(4, 13, generator=g)
        step(flat_model, flat, x, k < 3)
        step(piece_model, pieces, x, k < 3)
        what = f"{opt_name}/{groups_name} step {k}"
        assert_same(flat_model, piece_model, flat, pieces, what, exact)
    # a fresh flat optimizer takes the piecewise one's state_dict; one more step on both
    again = sharded(flat_model, make, groups, flat=True)
    again.load_state_dict(pieces.state_dict())
    x = torch.randn(4, 13, generator=g)
    step(flat_model, again, x, False)
    step(piece_model, pieces, x, False)
    assert_same(flat_model, piece_model, again, pieces, f"{opt_name}/{groups_name} loaded", exact)
    return {
        "pieces": len(flat.pieces),
        "flat_runs_before": runs_before,
        "flat_runs_after": sum(run.flat for run in flat.runs),
        "flat_runs_loaded": sum(run.flat for run in again.runs),
        "units": sum(len(g["params"]) for g in flat.local.param_groups) if flat.local else 0,
    }


@pytest.mark.parametrize(
    "opt_name, groups_name",
    [
        ("adamw", "one"),
        ("adamw", "nanogpt"),
        ("sgd", "one"),
        ("rmsprop", "nanogpt"),
        ("adamw_fused", "one"),
    ],
)
def test_flat_runs_step_exactly_as_one_piece_per_parameter(opt_name, groups_name):
    results = run_ranks(_flat_vs_pieces, 2, args=(opt_name, groups_name), timeout=120)
    # the runs holding a piece of `never` or `late` were split (on the ranks holding them)
    assert any(r["flat_runs_after"] < r["flat_runs_before"] for r in results), results
    for r in results:
        assert r["flat_runs_before"] > 0, r
        if groups_name == "one":  # the others stay flat: fewer tensors stepped than pieces
            assert 0 < r["flat_runs_after"] and r["units"] < r["pieces"], r
            assert r["flat_runs_loaded"] > 0, r
