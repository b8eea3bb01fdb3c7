"""The parameter server (``mg.parallelize(..., servers=S)``, plan style "server") on gloo + RPC.

W workers + S servers, spawned on 127.0.0.1 with a hard time bound. A recommender-shaped
model: a 100k-row embedding (each batch touches a few hundred rows), an EmbeddingBag, and a
dense head that is data-parallel among the workers. float64 throughout, so "equals serial"
is to 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from macrogen.runtime import param_server
from macrogen.runtime.data_parallel import DataParallelConfig
from tests.distributed import run_ranks

ROWS, BAG_ROWS, DIM = 100_000, 1_000, 8
BATCH, LENGTH = 8, 32  # per worker: 8 x 32 ids, ~256 unique rows of 100k
LR_DENSE = 0.1


class Rec(nn.Module):
    def __init__(self, rows: int = ROWS, dim: int = DIM):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, padding_idx=0)
        self.bag = nn.EmbeddingBag(BAG_ROWS, dim, mode="mean")
        self.head = nn.Linear(2 * dim, 1)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(ids).mean(1), self.bag(tags)], dim=1)
        return self.head(torch.tanh(x)).squeeze(-1)


def build(seed: int = 0) -> Rec:
    torch.manual_seed(seed)
    return Rec().double()


def batch(step: int, workers: int, worker: int | None = None):
    """Step ``step``'s batch of all workers (worker=None) or of one worker."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, ROWS, (workers * BATCH, LENGTH), generator=g)
    ids[:, -1] = 0  # the padding row is in every batch
    tags = torch.randint(0, BAG_ROWS, (workers * BATCH, 4), generator=g)
    y = torch.randn(workers * BATCH, generator=g, dtype=torch.float64)
    if worker is None:
        return ids, tags, y
    part = slice(worker * BATCH, (worker + 1) * BATCH)
    return ids[part], tags[part], y[part]


def serial(steps: int, workers: int, optimizer: str, lr: float) -> dict[str, torch.Tensor]:
    model = build()
    table = [model.emb.weight, model.bag.weight]
    dense = torch.optim.SGD(model.head.parameters(), lr=LR_DENSE)
    cls = torch.optim.Adagrad if optimizer == "adagrad" else torch.optim.SGD
    sparse = cls(table, lr=lr)
    for t in range(steps):
        ids, tags, y = batch(t, workers)
        loss = ((model(ids, tags) - y) ** 2).mean()
        dense.zero_grad()
        sparse.zero_grad()
        loss.backward()
        dense.step()
        sparse.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if optimizer == "adagrad":
        for name, p in (("emb", model.emb.weight), ("bag", model.bag.weight)):
            out[f"{name}.adagrad_sum"] = sparse.state[p]["sum"].clone()
    return out


def _train(rank: int, world: int, servers: int, staleness: int, optimizer: str, lr: float,
           steps: int, losses: bool = False) -> dict | None:  # fmt: skip
    workers = world - servers
    model = build()
    config = param_server.ServerConfig(servers, staleness, optimizer, lr, timeout_s=60)
    layers = [("emb", model.emb), ("bag", model.bag)]
    try:
        param_server.apply_param_server(
            model, layers, config, where="test", data_parallel=DataParallelConfig()
        )
    except SystemExit:
        return None  # a server: served until the workers shut down
    dense = torch.optim.SGD(model.parameters(), lr=LR_DENSE)
    seen = []
    for t in range(steps):
        ids, tags, y = batch(t, workers, rank)
        loss = ((model(ids, tags) - y) ** 2).mean()
        dense.zero_grad()
        loss.backward()
        dense.step()
        seen.append(loss.item())
    state = param_server.state_dict(model)
    state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    moved = param_server.traffic(model)
    param_server.shutdown()
    return {"state": state, "traffic": moved, "losses": seen, "steps": steps}


@pytest.mark.parametrize(
    "servers,optimizer", [(1, "sgd"), (2, "adagrad")], ids=["1server-sgd", "2servers-adagrad"]
)
def test_staleness_zero_equals_serial(servers, optimizer):
    steps, lr = 5, 0.5
    results = run_ranks(
        _train, world_size=2 + servers, args=(servers, 0, optimizer, lr, steps), timeout=120
    )
    assert results[2:] == [None] * servers
    want = serial(steps, 2, optimizer, lr)
    for got in results[:2]:
        state = got["state"]
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=key)
        assert (state["emb.weight"] != build().emb.weight).any(dim=1).sum() > 300  # it trained
        for key, t in got["traffic"].items():
            # ids go out once (int64), touched rows come back, their gradients go out
            assert t.rows == t.touched and t.grads == t.touched, key
            assert t.total <= 2 * t.touched + t.touched // DIM, key  # ids: 8 of a row's 64 bytes
