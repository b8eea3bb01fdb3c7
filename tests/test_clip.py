"""``mg.clip_grad_norm_`` on one process: torch's, whichever way its parameters are given."""

from __future__ import annotations

import pytest
import torch

import macrogen as mg


def _grads(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(3)]
    for p in params[:2]:  # the third has no gradient
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("order", [1.0, 2.0, float("inf")])
@pytest.mark.parametrize("given", ["list", "generator", "optimizer", "tensor"])
def test_clip_grad_norm_is_torchs(given, order):
    ours, theirs = _grads(0), _grads(0)
    if given == "tensor":
        ours, theirs = ours[:1], theirs[:1]
    arg = {
        "list": lambda: ours,
        "generator": lambda: iter(ours),
        "optimizer": lambda: torch.optim.SGD(ours, lr=0.1),
        "tensor": lambda: ours[0],
    }[given]()
    norm = mg.clip_grad_norm_(arg, 0.5, order)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, order)
    assert norm == want
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)
