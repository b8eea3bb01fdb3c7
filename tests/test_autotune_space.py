"""The candidate space (choices and macro constraints) and the search order."""

from __future__ import annotations

import textwrap

from macrogen.autotune import search, space
from macrogen.autotune.space import Parameter, TuningEnv
from macrogen.expand import expand_source

CPU1 = TuningEnv("cpu", 1, "cpu")


def _params(source: str) -> tuple[Parameter, ...]:
    return space.parameters(expand_source(textwrap.dedent(source), path="prog.py"))


def test_parameters_know_their_macro_and_argument() -> None:
    params = _params(
        """\
        import torch.distributed as dist
        import torch.nn as nn
        import macrogen as mg

        BLOCK = mg.tunable(64, choices=[32, 64])


        @mg.data_parallel(
            compress=None,
            bucket_mb=mg.tunable(25, choices=[1, 25]),
        )
        class Net(nn.Module):
            pass


        def sync(a):
            with mg.fused_allreduce(block=mg.tunable(1024, choices=[256, 1024])):
                dist.all_reduce(a)
        """
    )
    assert [(p.key, p.macro, p.argument, p.default, p.choices) for p in params] == [
        ("BLOCK", None, None, 64, (32, 64)),
        ("Net.bucket_mb", "data_parallel", "bucket_mb", 25, (1, 25)),
        ("sync.fused_allreduce.block", "fused_allreduce", "block", 1024, (256, 1024)),
    ]


def test_space_is_the_product_with_the_defaults_first() -> None:
    params = (
        Parameter("A", 2, (1, 2, 3), None, None),
        Parameter("B", "x", ("x", "y"), None, None),
    )
    built = space.build(params, CPU1)
    assert built.candidates[0] == {"A": 2, "B": "x"}
    assert len(built.candidates) == 6 and not built.excluded and not built.sampled
    assert {tuple(c.values()) for c in built.candidates} == {
        (a, b) for a in (1, 2, 3) for b in ("x", "y")
    }


def test_tensor_parallel_size_must_divide_the_world_size() -> None:
    params = _params(
        """\
        import torch.nn as nn
        import macrogen as mg

        @mg.tensor_parallel(plan={"fc": "colwise"}, size=mg.tunable(2, choices=[1, 2, 3, 4]))
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
        """
    )
    built = space.build(params, TuningEnv("cpu", 4, "cpu"))
    assert [c["Attn.size"] for c in built.candidates] == [2, 1, 4]
    assert built.excluded == (({"Attn.size": 3}, "Attn: size=3 does not divide the world size 4"),)


TILE = """\
    import macrogen as mg

    @mg.tile(i=mg.tunable(64, choices=[64, 2048]), j={j})
    def k(out, x):
        M, N = x.shape
        for i in range(M):
            for j in range(N):
                out[i, j] = x[i, j] * 2.0
    """


def test_a_triton_tile_must_fit_one_block_on_cuda_only() -> None:
    params = _params(TILE.format(j="mg.tunable(64, choices=[64, 1024])"))
    assert len(space.build(params, CPU1).candidates) == 4
    cuda = space.build(params, TuningEnv("cuda", 1, "gpu"))
    assert {"k.i": 2048, "k.j": 1024} not in cuda.candidates and len(cuda.candidates) == 3
    assert "more than Triton's 1048576" in cuda.excluded[0][1]


def test_a_constraint_sees_the_arguments_that_are_not_tunable() -> None:
    """j=1024 is written, not tuned: the tile macro still counts it."""
    params = _params(TILE.format(j="1024"))
    cuda = space.build(params, TuningEnv("cuda", 1, "gpu"))
    assert cuda.candidates == ({"k.i": 64},)
    assert (
        cuda.excluded[0][1]
        == "k: a 2048x1024 tile has 2097152 elements, more than Triton's 1048576"
    )


def test_a_macro_may_declare_its_own_constraint(monkeypatch) -> None:
    from macrogen.macros import fused_allreduce

    def only_small(arguments, env):
        return "too big" if arguments["block"] > 512 else None

    monkeypatch.setattr(fused_allreduce, "tuning_constraint", only_small, raising=False)
    params = _params(
        """\
        import torch.distributed as dist
        import macrogen as mg

        def f(a):
            with mg.fused_allreduce(block=mg.tunable(256, choices=[256, 1024])):
                dist.all_reduce(a)
        """
    )
    built = space.build(params, CPU1)
    assert built.candidates == ({"f.fused_allreduce.block": 256},)
    assert built.excluded[0][1] == "f.fused_allreduce: too big"


def test_small_spaces_are_searched_exhaustively() -> None:
    params = (Parameter("A", 1, tuple(range(1, 9)), None, None),)
    plan = search.plan(space.build(params, CPU1), max_trials=8, seed=0)
    assert plan.strategy == "exhaustive" and len(plan.order) == 8 and plan.patience is None
    for t in [5.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0]:
        plan.observe(t)
    assert not plan.done  # exhaustive: no early stop
    plan.observe(None)  # a failure counts as looked at
    assert plan.done and plan.stop_reason == "complete" and plan.best == 1.0


def test_large_spaces_are_sampled_in_a_seeded_order_with_early_stopping() -> None:
    params = (
        Parameter("A", 1, tuple(range(1, 11)), None, None),
        Parameter("B", 1, tuple(range(1, 11)), None, None),
    )
    built = space.build(params, CPU1)
    plan = search.plan(built, max_trials=20, seed=7, patience=3)
    again = search.plan(built, max_trials=20, seed=7, patience=3)
    assert (
        plan.strategy == "random" and plan.order == again.order
    )  # a resumed run walks the same way
    assert plan.order[0] == {"A": 1, "B": 1} and len(plan.order) == 20
    assert len({tuple(c.values()) for c in plan.order}) == 20
    plan.observe(10.0)
    plan.observe(9.0)  # a new best
    plan.observe(8.95)  # within 1%: not an improvement
    plan.observe(None)
    assert not plan.done
    plan.observe(12.0)
    assert plan.done and plan.stop_reason == "early stop" and plan.best == 8.95
