"""The parameter server (``mg.parallelize(..., servers=S)``, plan style "server") on gloo + RPC.

W workers + S servers, spawned on 127.0.0.1 with a hard time bound. A recommender-shaped
model: a 100k-row embedding (each batch touches a few hundred rows), an EmbeddingBag, and a
dense head that is data-parallel among the workers. float64 throughout, so "equals serial"
is to 1e-12.
"""

from __future__ import annotations

import io

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


SMALL = 2_000  # the staleness run's table: small enough to learn in 200 steps


def build(rows: int = ROWS) -> Rec:
    torch.manual_seed(0)
    return Rec(rows).double()


def batch(step: int, workers: int, worker: int | None = None, rows: int = ROWS):
    """Step ``step``'s batch of all workers (worker=None) or of one worker. The targets are a
    fixed teacher's (learnable) for the small table, noise for the large one."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, rows, (workers * BATCH, LENGTH), generator=g)
    ids[:, -1] = 0  # the padding row is in every batch
    tags = torch.randint(0, BAG_ROWS, (workers * BATCH, 4), generator=g)
    if rows == ROWS:
        y = torch.randn(workers * BATCH, generator=g, dtype=torch.float64)
    else:
        teacher = torch.randn(rows, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        y = 3 * teacher[ids].mean(1)
    if worker is None:
        return ids, tags, y
    part = slice(worker * BATCH, (worker + 1) * BATCH)
    return ids[part], tags[part], y[part]


def serial(
    steps: int, workers: int, optimizer: str, lr: float, rows: int = ROWS
) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(rows)
    table = [model.emb.weight, model.bag.weight]
    dense = torch.optim.SGD(model.head.parameters(), lr=LR_DENSE)
    cls = torch.optim.Adagrad if optimizer == "adagrad" else torch.optim.SGD
    sparse = cls(table, lr=lr)
    losses = []
    for t in range(steps):
        ids, tags, y = batch(t, workers, rows=rows)
        loss = ((model(ids, tags) - y) ** 2).mean()
        losses.append(loss.item())
        dense.zero_grad()
        sparse.zero_grad()
        loss.backward()
        dense.step()
        sparse.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if optimizer == "adagrad":
        for name, p in (("emb", model.emb.weight), ("bag", model.bag.weight)):
            out[f"{name}.adagrad_sum"] = sparse.state[p]["sum"].clone()
    return out, losses


def _train(rank: int, world: int, servers: int, staleness: int, optimizer: str, lr: float,
           steps: int, rows: int = ROWS, save_at: int | None = None, checkpoint: str = "",
           resume: bool = False) -> dict | None:  # fmt: skip
    workers = world - servers
    model = build(rows)
    config = param_server.ServerConfig(servers, staleness, optimizer, lr, timeout_s=60)
    layers = [("emb", model.emb), ("bag", model.bag)]
    try:
        param_server.apply_param_server(
            model, layers, config, where="test", data_parallel=DataParallelConfig()
        )
    except SystemExit:
        return None  # a server: served until the workers shut down
    dense = torch.optim.SGD(model.parameters(), lr=LR_DENSE)

    def run(start: int, stop: int) -> list[float]:
        seen = []
        for t in range(start, stop):
            ids, tags, y = batch(t, workers, rank, rows)
            loss = ((model(ids, tags) - y) ** 2).mean()
            dense.zero_grad()
            loss.backward()
            dense.step()
            seen.append(loss.item())
        return seen

    def snapshot() -> dict[str, torch.Tensor]:
        state = param_server.state_dict(model)
        state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return state

    def restore(saved: dict) -> None:
        param_server.load_state_dict(model, saved["tables"])
        model.load_state_dict(saved["model"])
        dense.load_state_dict(saved["optim"])

    if resume:  # a new job (maybe another number of servers) from the checkpoint file
        assert save_at is not None
        restore(torch.load(checkpoint, weights_only=True))
        run(save_at, steps)
        out = {"state": snapshot()}
        param_server.shutdown()
        return out
    out: dict = {"losses": run(0, save_at or steps)}
    if save_at is not None:  # a checkpoint (through bytes), more steps, then resume from it
        buffer = io.BytesIO()
        torch.save({"tables": param_server.state_dict(model), "model": model.state_dict(),
                    "optim": dense.state_dict()}, buffer)  # fmt: skip
        out["checkpoint"] = snapshot()
        if checkpoint and rank == 0:
            with open(checkpoint, "wb") as f:
                f.write(buffer.getvalue())
        run(save_at, steps)
        out["uninterrupted"] = snapshot()
        buffer.seek(0)
        restore(torch.load(buffer, weights_only=True))
        run(save_at, steps)
    out["state"] = snapshot()
    out["traffic"] = param_server.traffic(model)
    out["lag"] = param_server.max_lag(model)
    param_server.shutdown()
    return out


@pytest.mark.parametrize(
    "servers,optimizer", [(1, "sgd"), (2, "adagrad")], ids=["1server-sgd", "2servers-adagrad"]
)
def test_staleness_zero_equals_serial(servers, optimizer, tmp_path):
    steps, lr = 5, 0.5
    save_at = 3 if servers == 2 else None  # 2 + 2 also saves after step 3 and resumes from it
    checkpoint = str(tmp_path / "checkpoint.pt")
    results = run_ranks(
        _train,
        world_size=2 + servers,
        args=(servers, 0, optimizer, lr, steps, ROWS, save_at, checkpoint),
        timeout=150,
    )
    assert results[2:] == [None] * servers
    want, _ = serial(steps, 2, optimizer, lr)
    for got in results[:2]:
        assert got["lag"] == {"emb": 0, "bag": 0}
        state = got["state"]
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=key)
        assert (state["emb.weight"] != build().emb.weight).any(dim=1).sum() > 300  # it trained
        for key, t in got["traffic"].items():
            # ids go out once (int32), touched rows come back, their gradients go out
            assert t.rows == t.touched and t.grads == t.touched, key
            assert t.ids == t.touched // (DIM * 8) * 4, key  # 4 bytes per touched row
            assert t.total <= 2 * t.touched + t.touched // (2 * DIM), key
            print(f"{key}: {t.total / t.touched:.4f} x the touched rows' bytes")
        if save_at is None:
            continue
        # the checkpoint holds the server's rows and Adagrad state after step 3
        at_save, _ = serial(save_at, 2, optimizer, lr)
        for key in ("emb.weight", "emb.adagrad_sum", "bag.weight", "bag.adagrad_sum"):
            torch.testing.assert_close(got["checkpoint"][key], at_save[key], rtol=1e-12, atol=1e-12)
        assert int(got["checkpoint"]["emb.step"]) == save_at
        # resumed from it, steps 4-5 again give the uninterrupted run's state bit for bit
        for key, value in got["uninterrupted"].items():
            assert torch.equal(state[key], value), key
    if save_at is None:
        return
    # the job ends; a new one, on 1 server + 2 workers, resumes from the file: the same state
    resumed = run_ranks(
        _train,
        world_size=3,
        args=(1, 0, optimizer, lr, steps, ROWS, save_at, checkpoint, True),
        timeout=150,
    )
    for got in resumed[:2]:
        for key, value in want.items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-12, atol=1e-12, msg=key)


def test_staleness_two_trains_like_synchronous():
    """Hogwild with up to 2 steps of staleness: within 5% of the synchronous (= serial) loss
    after 200 steps, and no fetch ever lacked more than 2 steps of pushes."""
    steps, lr = 200, 0.5
    results = run_ranks(_train, world_size=3, args=(1, 2, "adagrad", lr, steps, SMALL), timeout=200)
    _, sync = serial(steps, 2, "adagrad", lr, rows=SMALL)
    last = [sum(r["losses"][-20:]) / 20 for r in results[:2]]
    stale, synchronous = sum(last) / 2, sum(sync[-20:]) / 20
    print(f"loss over the last 20 steps: staleness 2 {stale:.4f}, synchronous {synchronous:.4f}")
    assert sync[-1] < 0.6 * sync[0]  # it learns
    assert abs(stale - synchronous) <= 0.05 * synchronous
    for r in results[:2]:
        print(f"largest lag a fetch saw: {r['lag']}")
        assert 0 <= max(r["lag"].values()) <= 2


LOOP = """
    optim = torch.optim.SGD(model.parameters(), lr=LR_DENSE)
    for t in range(steps):
        ids, tags, y = batch(t, workers, rank)
        loss = ((model(ids, tags) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    state = param_server.state_dict(model)
    state.update(model.state_dict())
    param_server.shutdown()
    return state
"""

PROGRAM = (
    """
import torch
import macrogen as mg
from macrogen.runtime import param_server
from tests.test_param_server_dist import LR_DENSE, batch, build


def train(rank, workers, steps):
    model = build()
    model = mg.parallelize(model, servers=1, tp_plan={"emb": "server", "bag": "server"},
                           server_optimizer="adagrad", server_lr=0.5)
"""
    + LOOP
)

DECORATED = (
    """
import torch
import macrogen as mg
from macrogen.runtime import param_server
from tests.test_param_server_dist import LR_DENSE, Rec, batch


@mg.data_parallel(servers=1, server_plan=["emb", "bag"], server_optimizer="adagrad", server_lr=0.5)
class Model(Rec):
    def __init__(self):
        super().__init__()
        self.double()


def train(rank, workers, steps):
    torch.manual_seed(0)
    model = Model()
"""
    + LOOP
)


def _expanded(rank: int, world: int, tmp: str, steps: int, program: str = PROGRAM) -> dict | None:
    from pathlib import Path

    from tests.helpers import expand, load_module

    module = load_module(expand(program), f"expanded_ps_{rank}", Path(tmp))
    try:
        return module.train(rank, world - 1, steps)
    except SystemExit:
        return None  # the server rank


@pytest.mark.parametrize("program", [PROGRAM, DECORATED], ids=["parallelize", "data_parallel"])
def test_expanded_program_with_a_server_equals_serial(tmp_path, program):
    """The program as written (mg.parallelize or @data_parallel), expanded: 2 workers + 1 server
    equal the serial program."""
    results = run_ranks(_expanded, world_size=3, args=(str(tmp_path), 3, program), timeout=150)
    assert results[2] is None
    want, _ = serial(3, 2, "adagrad", 0.5)
    for got in results[:2]:
        for key, value in want.items():  # the dense model, the tables and their Adagrad sums
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=key)


def _one_leaves(rank: int, world: int) -> str | None:
    """Worker 1 leaves after step 0; worker 0's fetch for step 2 needs its step-1 push."""
    model = build(SMALL)
    config = param_server.ServerConfig(1, 0, "sgd", 0.5, timeout_s=60)
    try:
        param_server.apply_param_server(model, [("emb", model.emb), ("bag", model.bag)], config,
                                        where="test")  # fmt: skip
    except SystemExit:
        return None
    steps = 1 if rank == 1 else 3
    try:
        for t in range(steps):
            ids, tags, y = batch(t, 2, rank, SMALL)
            ((model(ids, tags) - y) ** 2).mean().backward()
    except RuntimeError as e:
        return str(e)
    finally:
        param_server.shutdown()
    return "trained"


def test_a_worker_that_leaves_early_is_named_at_once():
    """Synchronous: a step needs every worker's push; a worker that said it is done before
    pushing it is named in the others' error at once (not after the fetch timeout)."""
    results = run_ranks(_one_leaves, world_size=3, timeout=60)
    assert results[1] == "trained" and results[2] is None
    assert (
        "needs worker 1's push for its step 1, but worker 1 said it was done after 1 step"
        in (results[0])
    )


def _readers_left(rank: int, world: int) -> list[str] | None:
    """1 worker + 1 server; the server's readers linger a moment after their last request."""
    import threading
    import time

    from macrogen.runtime import param_server_wire

    read = param_server_wire.Server._read

    def slow_read(self: param_server_wire.Server, worker: int) -> None:
        read(self, worker)
        time.sleep(0.5)  # (the thread still holds the server, and its process group)

    param_server_wire.Server._read = slow_read  # type: ignore[method-assign]
    model = build(SMALL)
    config = param_server.ServerConfig(1, 0, "sgd", 0.5, timeout_s=60)
    try:
        param_server.apply_param_server(model, [("emb", model.emb), ("bag", model.bag)], config,
                                        where="test")  # fmt: skip
    except SystemExit:  # the server: none of its readers may outlive serve()
        return [t.name for t in threading.enumerate() if t.name.startswith("mg-ps-read")]
    ids, tags, y = batch(0, 1, 0, SMALL)
    ((model(ids, tags) - y) ** 2).mean().backward()
    param_server.shutdown()
    return None


def test_no_server_reader_outlives_serve():
    """A reader thread left running past serve() holds the last reference to the process
    group once it is destroyed at exit, and drops it while the interpreter finalizes: the
    server then aborts (SIGABRT, "terminate called without an active exception")."""
    results = run_ranks(_readers_left, world_size=2, timeout=60)
    assert results == [None, []]
