"""The optimizer step on the engine's DTensor parameters runs on their local tensors
(``runtime/parallelize/local_step.py``): bit for bit the DTensor step, with the state and
``state_dict()`` DTensors as before, and the DTensor step wherever the local one can't be
exact (a closure, an optimizer class not known to be elementwise)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.distributed import run_ranks

PLAN = {"fc": "colwise", "proj": "rowwise"}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(self.norm(x))))


OPTIMIZERS = {
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adamw amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adagrad (not elementwise-listed)": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def _unmarked(model: nn.Module) -> nn.Module:
    """A copy whose parameters step as DTensors (the marks removed): the reference."""
    from macrogen.runtime.parallelize.local_step import LOCAL_STEP

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        if hasattr(p, LOCAL_STEP):
            delattr(p, LOCAL_STEP)
    return twin


def _steps(rank: int, world: int) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.parallelize import apply_tensor_parallel, device_mesh
    from macrogen.runtime.parallelize.local_step import LOCAL_STEP

    torch.set_default_dtype(torch.float64)
    mesh = device_mesh(tp=world, planned=True, where="test")
    stepped: dict[str, int] = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        ours = apply_tensor_parallel(_MLP(), mesh, PLAN, where="test")
        assert all(getattr(p, LOCAL_STEP, False) for p in ours.parameters())
        ref = _unmarked(ours)
        opts = [make(list(m.parameters())) for m in (ours, ref)]
        steps = [0, 0]
        dtensors: list[list[bool]] = [[], []]  # did a step see DTensor parameters?
        for i, (model, opt) in enumerate(zip((ours, ref), opts)):
            opt.register_step_post_hook(
                lambda o, a, k, i=i, steps=steps: steps.__setitem__(i, steps[i] + 1)
            )
            opt.register_step_pre_hook(  # (after the global hooks: it sees the swap)
                lambda o, a, k, i=i, seen=dtensors: seen[i].append(
                    any(isinstance(p, DTensor) for g in o.param_groups for p in g["params"])
                )
            )
            gen = torch.Generator().manual_seed(1)
            for step in range(3):
                x = torch.randn(4, 8, generator=gen)
                loss = model(x).pow(2).mean()
                loss.backward()
                if step == 2:  # a closure may run a backward: the DTensor step
                    opt.step(lambda: None)
                else:
                    opt.step()
                opt.zero_grad()
        for (key, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a.to_local(), b.to_local()), (name, key)
        states = [o.state_dict()["state"] for o in opts]
        for index, entries in states[1].items():
            for key, value in entries.items():
                mine = states[0][index][key]
                assert type(mine) is type(value), (name, index, key, type(mine))
                if isinstance(value, DTensor):
                    assert mine.placements == value.placements, (name, index, key)
                    assert torch.equal(mine.to_local(), value.to_local()), (name, index, key)
                else:
                    assert torch.equal(mine, value), (name, index, key)
        for group in opts[0].param_groups:  # the parameters are back in their groups
            assert all(isinstance(p, DTensor) for p in group["params"])
        assert steps == [3, 3], (name, steps)
        local = name.startswith(("sgd", "adam"))
        assert dtensors == [[not local, not local, True], [True] * 3], (name, dtensors)
        stepped[name] = len(states[0])
    return stepped


def test_local_step_equals_the_dtensor_step():
    first, second = run_ranks(_steps, 2, timeout=120)
    assert first == second
    assert all(count == 6 for count in first.values()), first  # every parameter has state
