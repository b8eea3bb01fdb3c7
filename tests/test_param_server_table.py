"""A server's table in one process (no RPC): the consistency model's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from macrogen.runtime.param_server import ServerConfig, _Table


def table(staleness: int, optimizer: str = "sgd") -> _Table:
    config = ServerConfig(1, staleness, optimizer, lr=1.0, timeout_s=0.2)
    return _Table(torch.zeros(10, 2, dtype=torch.float64), config, workers=2)


def test_synchronous_applies_a_step_once_every_worker_pushed_it():
    t = table(0)
    ids = torch.tensor([1, 3], dtype=torch.int32)
    t.fetch(0, 0, ids, training=True)
    t.fetch(1, 0, ids[:1], training=True)
    t.push(0, 0, torch.ones(2, 2, dtype=torch.float64))
    assert t.rows.abs().sum() == 0  # worker 1's push is missing: nothing applied yet
    with pytest.raises(TimeoutError, match="worker 0's step 1 waited"):
        t.fetch(0, 1, ids, training=False)  # step 1 waits for step 0 of every worker
    t.push(1, 0, torch.ones(1, 2, dtype=torch.float64))
    # row 1: both workers' gradients, averaged (sum / 2); row 3: worker 0's only
    assert t.fetch(0, 1, ids, training=False).tolist() == [[-1.0, -1.0], [-0.5, -0.5]]
    assert t.max_lag == 0


def test_staleness_lets_a_worker_run_that_many_steps_ahead_and_no_more():
    t = table(2)
    ids = torch.tensor([4])
    for step in range(3):  # worker 0 alone: steps 0, 1 and 2 fetch; worker 1 pushes nothing
        t.fetch(0, step, ids, training=True)
        t.push(0, step, torch.ones(1, 2, dtype=torch.float64))  # applied at once (Hogwild)
    assert t.rows[4].tolist() == [-1.5, -1.5] and t.max_lag == 2
    with pytest.raises(TimeoutError):
        t.fetch(0, 3, ids, training=True)  # 3 steps ahead of worker 1: waits


def test_a_push_without_its_fetch_is_an_error():
    t = table(0)
    with pytest.raises(RuntimeError, match="without a matching training fetch"):
        t.push(0, 0, torch.ones(1, 2, dtype=torch.float64))


def test_adagrad_follows_torch():
    t = table(1, "adagrad")
    ids = torch.tensor([2, 5])
    grads = torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.float64)
    t.fetch(0, 0, ids, training=True)
    t.push(0, 0, grads)
    ref = torch.zeros(10, 2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adagrad([ref], lr=1.0)
    ref.grad = torch.zeros_like(ref)
    ref.grad[ids] = grads / 2  # one push of 2 workers: divided by W
    opt.step()
    torch.testing.assert_close(t.rows, ref.detach(), rtol=0, atol=1e-15)
    torch.testing.assert_close(t.sum, opt.state[ref]["sum"], rtol=0, atol=1e-15)
