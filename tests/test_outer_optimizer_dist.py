"""@data_parallel(outer=outer_sgd(...), overlap=True): local SGD's outer optimizer on 2 gloo ranks.

One spawned run (fp64, a two-layer net, 10 optimizer steps, sync_every=3: the
ranks synchronize after steps 0, 3, 6 and 9) returns each check's figures, and a
test per check asserts them in the parent:

- ``outer=None`` is bit-identical to plain ``sync_every`` (today's averaging);
- outer SGD with lr 1 and no momentum equals plain averaging (also after a
  synchronous warm-up);
- Nesterov outer SGD matches DiLoCo's pseudo-code, simulated here serially for
  both workers, to 1e-6 after 3 rounds;
- ``overlap=True, delay=0`` is bit-identical to ``overlap=False``;
- ``delay=1`` matches the same simulation with each outer step applied one
  inner step late (the local steps in between kept on top);
- an overlapped run issues one asynchronous all-reduce per round and nothing else;
- a ``resumable`` checkpoint holds the outer state and the round in flight: 4
  steps, a checkpoint, 4 steps in a fresh model resumed from it equal 8 steps.
"""

from __future__ import annotations

import functools
import textwrap

import pytest
import torch
import torch.distributed as dist

from macrogen.expand import expand_source
from macrogen.runtime import local_sgd
from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync, flush, gradient_sync
from macrogen.runtime.mesh import SERIAL
from tests.dist_checks import each_rank, run_check
from tests.distributed import run_ranks
from tests.helpers import load_module

EVERY = 3
STEPS = 10  # synchronizations after steps 0, 3, 6, 9 (0-based), as PeriodicModelAverager
MODELS = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    import macrogen as mg


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x, y):
            return ((self.b(torch.tanh(self.a(x))).squeeze(-1) - y) ** 2).mean()


    @mg.data_parallel(sync_every=3)
    class Plain(Net):
        pass


    @mg.data_parallel(sync_every=3, outer=None)
    class OuterNone(Net):
        pass


    @mg.data_parallel(sync_every=3, outer=mg.outer_sgd(lr=1.0, momentum=0.0, nesterov=False))
    class OuterOne(Net):
        pass


    @mg.data_parallel(sync_every=3, sync_warmup=2)
    class PlainWarm(Net):
        pass


    @mg.data_parallel(sync_every=3, sync_warmup=2, outer=mg.outer_sgd(lr=1, momentum=0.0, nesterov=False))
    class OuterOneWarm(Net):
        pass


    @mg.data_parallel(sync_every=3, outer=mg.outer_sgd(lr=0.7, momentum=0.9, nesterov=True))
    class Nesterov(Net):
        pass


    @mg.data_parallel(sync_every=3, outer=mg.outer_sgd(), overlap=True, delay=0)
    class Delay0(Net):
        pass


    @mg.data_parallel(sync_every=3, outer=mg.outer_sgd(), overlap=True)
    class Delay1(Net):
        pass
    """
)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(
        6, generator=g, dtype=torch.float64
    )


def inner(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(model, rank: int, steps: int = STEPS) -> torch.nn.Module:
    opt = inner(model.parameters())
    for t in range(steps):
        opt.zero_grad()
        model(*data(rank, t)).backward()
        opt.step()
    return model


def build(cls):
    torch.manual_seed(0)
    return cls().double()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def diloco(net_cls, world: int, rounds: list[int], lr=0.7, momentum=0.9, nesterov=True):
    """DiLoCo (Douillard et al. 2023, Algorithm 1), both workers simulated in one process:

        for outer step t = 1..T:
            for worker i:                    theta_i <- theta(t-1)
                for inner step h = 1..H_t:   theta_i <- InnerOpt(theta_i, grad of worker i's batch)
                delta_i <- theta(t-1) - theta_i
            delta <- mean_i delta_i
            theta(t) <- OuterOpt(theta(t-1), delta)      (SGD, Nesterov momentum)

    Each worker keeps its inner optimizer's state across rounds (the paper's AdamW
    state; here SGD with momentum). ``rounds``: H_t per round.
    """
    theta = build(net_cls)
    workers = [build(net_cls) for _ in range(world)]
    inner_opts = [inner(w.parameters()) for w in workers]
    outer = torch.optim.SGD(theta.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)
    step = 0
    for h_t in rounds:
        deltas = []
        for i, (w, opt) in enumerate(zip(workers, inner_opts)):
            with torch.no_grad():
                for pw, p in zip(w.parameters(), theta.parameters()):
                    pw.copy_(p)
            for h in range(h_t):
                opt.zero_grad()
                w(*data(i, step + h)).backward()
                opt.step()
            deltas.append(
                [p.detach() - pw.detach() for p, pw in zip(theta.parameters(), w.parameters())]
            )
        step += h_t
        outer.zero_grad()
        for j, p in enumerate(theta.parameters()):
            p.grad = sum(d[j] for d in deltas) / world
        outer.step()
    return theta


def delayed(net_cls, world: int, steps: int, every: int, delay: int):
    """The overlapped schedule, simulated step by step: a round's all-reduce starts after
    step s (s % every == 0) and its outer step lands after step s + delay, where each worker's
    parameters become new + (theirs now - theirs at the start of the round)."""
    workers = [build(net_cls) for _ in range(world)]
    opts = [inner(w.parameters()) for w in workers]
    synced = flat(workers[0])
    momentum = torch.zeros_like(synced)
    flight = None  # (due step, averaged delta, each worker's sent parameters)

    def land(delta, sent):
        nonlocal synced, momentum
        momentum = 0.9 * momentum + delta
        synced = synced - 0.7 * (delta + 0.9 * momentum)
        for w, mine in zip(workers, sent):
            set_flat(w, flat(w) - mine + synced if delay else synced)

    for s in range(steps):
        for i, (w, opt) in enumerate(zip(workers, opts)):
            opt.zero_grad()
            w(*data(i, s)).backward()
            opt.step()
        if flight is not None and flight[0] == s:
            land(*flight[1:])
            flight = None
        if s % every == 0:
            sent = [flat(w) for w in workers]
            flight = (s + delay, sum(synced - x for x in sent) / world, sent)
            if delay == 0:
                land(*flight[1:])
                flight = None
    return workers


def set_flat(model, values: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[at : at + p.numel()].view_as(p))
            at += p.numel()


class CountAllReduce:
    def __enter__(self):
        self.calls, self.async_calls, self._orig = 0, 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            self.async_calls += bool(kwargs.get("async_op"))
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return (flat(a) - flat(b)).abs().max().item()


def _overlap_delay0(m, rank: int, world: int) -> dict:
    sync_run = train(build(m.Nesterov), rank)
    with CountAllReduce() as count:
        delay0 = train(build(m.Delay0), rank)
    return {
        "bit-identical to overlap=False": torch.equal(flat(delay0), flat(sync_run)),
        "vs simulation": _max_diff(delay0, delayed(m.Net, world, STEPS, EVERY, 0)[rank]),
        "calls": (count.calls, count.async_calls),
    }


def _overlap_delay1(m, rank: int, world: int) -> dict:
    with CountAllReduce() as count:
        delay1 = train(build(m.Delay1), rank)
    report = {
        "vs simulation": _max_diff(delay1, delayed(m.Net, world, STEPS, EVERY, 1)[rank]),
        "calls": (count.calls, count.async_calls),
        "in flight after the run": gradient_sync(delay1).local_sgd.due,
    }
    flush(delay1)  # the round sent after step 9 lands now
    report["flushed"] = gradient_sync(delay1).local_sgd.due
    return report


def _converted(m, rank: int) -> str:
    moved = train(build(m.Nesterov), rank, steps=2).float()  # the outer state is float64
    try:
        x, y = data(rank, 2)
        moved(x.float(), y.float()).backward()
        inner(moved.parameters()).step()
        return "no error"
    except RuntimeError as e:
        return str(e)


def _cases(rank: int, world: int, out_dir: str) -> dict:
    """Every check's figures (or its error), by name: one spawn for them all."""
    from pathlib import Path

    code = expand_source(MODELS, path="outer_models.py").code
    m = load_module(code, f"outer_models_rank{rank}", Path(out_dir))
    report: dict = {}
    check = functools.partial(run_check, report)
    check(
        "outer=None",
        lambda: torch.equal(
            flat(train(build(m.OuterNone), rank)), flat(train(build(m.Plain), rank))
        ),
    )
    check(
        "outer lr 1", lambda: _max_diff(train(build(m.OuterOne), rank), train(build(m.Plain), rank))
    )
    # after 2 synchronous steps: the outer optimizer starts from the warmed-up parameters
    check(
        "outer lr 1 after a warm-up",
        lambda: _max_diff(train(build(m.OuterOneWarm), rank), train(build(m.PlainWarm), rank)),
    )
    # 3 rounds: after steps 0, 3 and 6, i.e. 1, 3 and 3 inner steps
    check(
        "nesterov",
        lambda: _max_diff(
            train(build(m.Nesterov), rank, steps=7), diloco(m.Net, world, rounds=[1, 3, 3])
        ),
    )
    check("delay=0", lambda: _overlap_delay0(m, rank, world))
    check("delay=1", lambda: _overlap_delay1(m, rank, world))
    check("converted", lambda: _converted(m, rank))
    check("resume", lambda: _resume(rank, world, out_dir))  # (in the same processes: one spawn)
    return report


@pytest.fixture(scope="module")
def outer(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer_optimizer")
    return run_ranks(_cases, 2, args=(str(out),), timeout=120)


def test_outer_none_is_bit_identical_to_plain_averaging(outer):
    assert each_rank(outer, "outer=None") == [True, True]


def test_outer_sgd_lr_1_without_momentum_is_plain_averaging(outer):
    for rank, diff in enumerate(each_rank(outer, "outer lr 1")):
        assert diff <= 1e-12, f"rank {rank}: {diff:.3g} from plain averaging"


def test_outer_sgd_lr_1_after_a_synchronous_warm_up_is_plain_averaging(outer):
    for rank, diff in enumerate(each_rank(outer, "outer lr 1 after a warm-up")):
        assert diff <= 1e-12, f"rank {rank}: {diff:.3g} from plain averaging"


def test_nesterov_outer_sgd_matches_diloco(outer):
    for rank, diff in enumerate(each_rank(outer, "nesterov")):
        assert diff <= 1e-6, f"rank {rank}: {diff:.3g} from DiLoCo's pseudo-code"


def test_overlap_with_delay_0_is_bit_identical_to_no_overlap(outer):
    for rank, r in enumerate(each_rank(outer, "delay=0")):
        assert r["bit-identical to overlap=False"], rank
        assert r["vs simulation"] <= 1e-9, f"rank {rank}: {r['vs simulation']:.3g}"


def test_delay_1_applies_each_outer_step_one_inner_step_late(outer):
    for rank, r in enumerate(each_rank(outer, "delay=1")):
        assert r["vs simulation"] <= 1e-9, f"rank {rank}: {r['vs simulation']:.3g}"
        assert r["in flight after the run"] == 10, rank  # sent after step 9, due after step 10
        assert r["flushed"] == -1, rank


def test_an_overlapped_run_issues_one_asynchronous_all_reduce_per_round(outer):
    # 4 rounds; the overlapped ones asynchronous, no gradient all-reduce in between
    for delay in ("delay=0", "delay=1"):
        for rank, r in enumerate(each_rank(outer, delay)):
            assert r["calls"] == (4, 4), f"{delay}, rank {rank}: (calls, asynchronous calls)"


def test_parameters_converted_after_outer_steps_began_are_refused(outer):
    for message in each_rank(outer, "converted"):
        assert "replaced, moved or converted after local SGD's outer steps began" in message


def test_a_checkpoint_with_a_round_in_flight_resumes_exactly(outer):
    # a checkpoint taken after step 3 with that round in flight (due after step 4)
    for r in each_rank(outer, "resume"):
        assert r == {"due at the checkpoint": 4, "steps": 8, "equal": True}


def _resume(rank: int, world: int, out_dir: str) -> dict:
    """8 steps straight, against 4 steps, a checkpoint (a round in flight: sent after step 3,
    due after step 4) and 4 more steps in a fresh model resumed from it. Both ranks see the
    same data, so their parameters agree and one stored copy of them is exact."""
    from pathlib import Path

    from macrogen.runtime.checkpoint import resumable

    code = expand_source(MODELS, path="outer_models.py").code
    m = load_module(code, f"outer_models_resume_rank{rank}", Path(out_dir))

    def run(model, stop=None):
        opt = inner(model.parameters())
        loop = resumable(range(8), model=model, optimizer=opt, dir=Path(out_dir) / "ckpt", every=4)
        loaded = gradient_sync(model).local_sgd.due  # the start-up loaded the checkpoint
        for s in loop:
            opt.zero_grad()
            model(*data(0, s)).backward()
            opt.step()
            if s == stop:  # (the save after step 3 ran when the loop asked for step 4)
                break
        return model, loaded

    straight = build(m.Delay1)
    opt = inner(straight.parameters())
    for s in range(8):
        opt.zero_grad()
        straight(*data(0, s)).backward()
        opt.step()
    run(build(m.Delay1), stop=4)
    resumed, loaded = run(build(m.Delay1))
    local = gradient_sync(resumed).local_sgd
    report = {"due at the checkpoint": loaded, "steps": local.steps}
    flush(straight)
    flush(resumed)
    report["equal"] = torch.equal(flat(resumed), flat(straight))
    return report


def test_delay_beyond_sync_every_is_refused():
    model = torch.nn.Linear(2, 2)
    config = DataParallelConfig(sync_every=2, overlap=True, delay=3)
    sync = GradientSync(model, DataParallelConfig(), where="t.py:1", mesh=SERIAL)
    sync.config = config
    with pytest.raises(ValueError, match="delay=3 must be between 0 and sync_every=2"):
        local_sgd.LocalSGD(sync)
