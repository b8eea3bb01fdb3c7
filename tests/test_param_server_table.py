"""A server's table in one process (no communication): the consistency model's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from macrogen.runtime.param_server_table import PushError, ServerConfig, ServerTable


def table(staleness: int, optimizer: str = "sgd") -> ServerTable:
    config = ServerConfig(1, staleness, optimizer, lr=1.0)
    return ServerTable(torch.zeros(10, 2, dtype=torch.float64), config, workers=2)


def test_synchronous_applies_a_step_once_every_worker_pushed_it():
    t = table(0)
    ids = torch.tensor([1, 3], dtype=torch.int32)
    assert t.ready(0)
    t.read(0, 0, ids, training=True)
    t.read(1, 0, ids[:1], training=True)
    t.push(0, 0, torch.ones(2, 2, dtype=torch.float64))
    assert t.rows.abs().sum() == 0  # worker 1's push is missing: nothing applied yet
    assert not t.ready(1) and not t.settled(1)  # step 1 waits for step 0 of every worker
    t.push(1, 0, torch.ones(1, 2, dtype=torch.float64))
    assert t.ready(1) and t.settled(1)
    # row 1: both workers' gradients, averaged (sum / 2); row 3: worker 0's only
    assert t.read(0, 1, ids, training=False).tolist() == [[-1.0, -1.0], [-0.5, -0.5]]
    assert t.max_lag == 0


def test_staleness_lets_a_worker_run_that_many_steps_ahead_and_no_more():
    t = table(2)
    ids = torch.tensor([4])
    for step in range(3):  # worker 0 alone: steps 0, 1 and 2 fetch; worker 1 pushes nothing
        assert t.ready(step)
        t.read(0, step, ids, training=True)
        t.push(0, step, torch.ones(1, 2, dtype=torch.float64))  # applied at once (Hogwild)
    assert t.rows[4].tolist() == [-1.5, -1.5] and t.max_lag == 2
    assert not t.ready(3)  # 3 steps ahead of worker 1: waits


def test_a_request_that_needs_a_departed_workers_pushes_is_named():
    t = table(0)
    ids = torch.tensor([4])
    t.read(0, 0, ids, training=True)
    t.push(0, 0, torch.ones(1, 2, dtype=torch.float64))
    assert t.missing(1, gone=set()) is None  # worker 1 may still push
    assert t.missing(1, gone={1}) == 1  # it left without pushing step 0
    assert t.missing(0, gone={1}) is None


def test_a_push_without_its_fetch_is_an_error():
    t = table(0)
    with pytest.raises(PushError, match="without a matching training fetch"):
        t.push(0, 0, torch.ones(1, 2, dtype=torch.float64))


def test_ids_outside_the_share_are_named_before_any_read():
    t = table(0)
    assert t.check_ids(torch.tensor([0, 9])) is None
    assert "outside 0..9" in t.check_ids(torch.tensor([10]))
    assert "outside 0..9" in t.check_ids(torch.tensor([-1]))


def test_adagrad_follows_torch():
    t = table(1, "adagrad")
    ids = torch.tensor([2, 5])
    grads = torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.float64)
    t.read(0, 0, ids, training=True)
    t.push(0, 0, grads)
    ref = torch.zeros(10, 2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adagrad([ref], lr=1.0)
    ref.grad = torch.zeros_like(ref)
    ref.grad[ids] = grads / 2  # one push of 2 workers: divided by W
    opt.step()
    torch.testing.assert_close(t.rows, ref.detach(), rtol=0, atol=1e-15)
    torch.testing.assert_close(t.sum, opt.state[ref]["sum"], rtol=0, atol=1e-15)
