"""``macrogen plan`` for a model built on the meta device (``--meta``, ``memory.predict(meta=)``):
no whole-model build term, and per layout what each rank holds."""

from __future__ import annotations

from macrogen.autotune import memory, planner
from macrogen.autotune.layouts import Layout, ModelShape
from macrogen.cli import main
from tests.test_plan_cli import BIG, NODES, _with_probe


def test_a_meta_build_has_no_build_term():
    fsdp = Layout(dp="fsdp")
    built = memory.predict(BIG, fsdp, 64)
    meta = memory.predict(BIG, fsdp, 64, meta=True)
    assert built.build > BIG.param_bytes  # the whole model, and the shards cut from it
    assert meta.build == 0.0 and meta.total == meta.step == built.step
    assert meta.total < 20e9 < built.total  # 28 GB whole while built: over 20 GB only then


def test_layouts_that_fit_only_without_the_whole_model_become_feasible():
    shape = ModelShape(32, {"heads": 32})
    built = {r.layout for r in planner.rank(BIG, shape, 64, NODES, 20e9) if r.step is not None}
    meta = {r.layout for r in planner.rank(BIG, shape, 64, NODES, 20e9, meta=True)
            if r.step is not None}  # fmt: skip
    assert built < meta  # every layout feasible when built is, and more
    assert Layout(dp="fsdp") in meta - built


def test_plan_says_what_each_rank_holds(tmp_path, capsys):
    src, db = _with_probe(tmp_path)
    argv = ["plan", str(src), "--world-size", "64", "--gpu-memory", "20GB", "--tuning", str(db)]
    assert main(argv) == 1  # the whole 28 GB model on every rank while it is cut: none fits
    capsys.readouterr()
    assert main([*argv, "--meta"]) == 0
    meta = capsys.readouterr().out
    assert "the model built on the meta device" in meta
    header = next(line for line in meta.splitlines() if "memory/rank" in line)
    assert header.split()[-4:] == ["params", "grads", "state", "activ."]
    assert int(meta.splitlines()[0].split()[0]) > 0  # "N feasible layout(s) of 64 ranks"
