"""``macrogen plan``: layouts ranked for a machine this one is not; bad input is one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from macrogen.autotune import cost, database, memory, planner
from macrogen.autotune.layouts import Layout, ModelShape
from macrogen.autotune.probe import MEASURES
from macrogen.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layout_auto.py"

# a 7B-ish model: 28 GB of fp32 parameters, Adam's state twice that
BIG = memory.Profile(
    param_bytes=28 * 10**9,
    sharded_bytes=26 * 10**9,
    block_bytes=27 * 10**9,
    blocks=32,
    state_bytes=56 * 10**9,
    transient_bytes=28 * 10**9 + 64 * 10**9,
    step_s=64.0,
    block_s=60.0,
    message_bytes=2 * 10**9,
)
NODES = cost.Machine(8, cost.Link("nvlink", 900e9), cost.Link("ib", 50e9))


def test_memory_prunes_replication_of_a_big_model():
    rows = planner.rank(BIG, ModelShape(32, {"heads": 32}), 64, NODES, 80e9)
    feasible = [r for r in rows if r.step is not None]
    assert feasible and all(r.memory.total <= 80e9 for r in feasible)
    replicate = next(r for r in rows if r.layout == Layout(dp="replicate"))
    assert replicate.reason is not None and "over 80.0 GB" in replicate.reason
    assert feasible[0].layout.dp == "fsdp" or feasible[0].layout.tp > 1
    assert [r.step.total for r in feasible] == sorted(r.step.total for r in feasible)


def test_unsupported_layouts_are_predicted_and_marked():
    rows = planner.rank(BIG, ModelShape(32, {}), 64, NODES, None)
    zero1 = next(r for r in rows if r.layout.dp == "zero1" and r.layout.tp > 1 and r.step)
    assert zero1.note is None  # ZeRO-1 over tensor-parallel shards runs
    alone = next(r for r in rows if r.layout.pp == 2 and r.layout.tp == 1 and r.step is not None)
    assert alone.note is None  # mg.parallelize cuts a built model's stages
    piped = next(r for r in rows if r.layout.pp == 2 and r.layout.tp > 1 and r.layout.dp == "fsdp")
    assert piped.note is None  # and shards their layers


def _with_probe(tmp_path: Path, rows: int = 1024) -> tuple[Path, Path]:
    """The example and a tuning database holding its probe (as autotune stores it); the
    entry's batch of ``rows`` rows."""
    src = tmp_path / "layout_auto.py"
    shutil.copy(EXAMPLE, src)
    db = tmp_path / "tuning.json"
    probe = {
        "profile": {**BIG.__dict__},
        "shape": {"blocks": 8, "divisible": {"layers.0.n_head": 6}, "rows": rows},
        "source_hash": database.source_hash(src.read_text()),
        "measures": MEASURES,
    }
    record = {
        "candidates": [],
        "generation": 1,
        "key": {"entry": ":build", "file": src.name, "signature": {}, "target": "cpu"},
        "layout_probe": probe,
        "source_hash": probe["source_hash"],
        "winner": None,
    }
    db.write_text(json.dumps({"format": "macrogen-tuning", "version": 2, "records": [record]}))
    return src, db


def test_plan_ranks_layouts_from_the_stored_probe(tmp_path, capsys):
    src, db = _with_probe(tmp_path)
    status = main(
        [
            "plan",
            str(src),
            "--world-size",
            "64",
            "--gpu-memory",
            "80GB",
            "--link",
            "nvlink:900GB/s,ib:50GB/s",
            "--tuning",
            str(db),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "feasible layout(s) of 64 ranks" in out
    assert "infeasible (" in out and "n_head = 6 is not divisible by tp=4" in out
    assert "over 80.0 GB" in out  # replicating 28 GB of parameters + Adam does not fit
    first = out.splitlines()[2]
    assert first.lstrip().startswith("1 ")


def test_a_batch_that_does_not_split_rules_the_layout_out_until_it_grows(tmp_path, capsys):
    src, db = _with_probe(tmp_path, rows=16)
    argv = ["plan", str(src), "--world-size", "32", "--tuning", str(db), "--top", "200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a batch of 16 rows does not split into 32 data ranks (equal shares)" in out
    assert re.search(
        r"a batch of 16 rows does not split into \d+ data ranks x \d+ micro-batches", out
    )
    assert " dp32 (" not in out and " dp16 (" in out  # tp2 x dp16: a row each
    assert main([*argv, "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert " dp32 (" in out and "rows does not split" not in out


def test_a_larger_batch_grows_what_grows_with_rows():
    small = memory.Profile(
        param_bytes=100,
        sharded_bytes=0,
        block_bytes=80,
        blocks=2,
        state_bytes=200,
        transient_bytes=100 + 40,
        step_s=10.0,
        step_one_thread_s=20.0,
        block_s=8.0,
        block_call_s=0.5,
        optimizer_s=1.0,
        data_bytes=8,
        message_bytes=16,
    )
    big = memory.with_batch(small, 4.0)
    # the blocks' fixed cost (2 x 0.5 s) and the optimizer step (1 s) stay; the rest x4
    assert big.step_s == pytest.approx(2.0 + 8.0 * 4) and big.block_s == pytest.approx(1 + 7 * 4)
    assert big.step_one_thread_s == pytest.approx(20.0 * 34 / 10)
    assert (big.activation_bytes, big.data_bytes, big.message_bytes) == (160, 32, 64)
    assert (big.param_bytes, big.state_bytes, big.optimizer_s) == (100, 200, 1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--link", "nvlink=fast"], "expected NAME:BANDWIDTH"),
        (["--link", "nvlink:.GB/s"], "--link 'nvlink:.GB/s'"),
        (["--gpu-memory", "lots"], "--gpu-memory 'lots': expected a size"),
        (["--gpu-memory", "nan"], "--gpu-memory 'nan'"),  # was: no limit at all
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--world-size", "abc"], "--world-size 'abc': expected a whole number"),
        (["--world-size", str(2**41)], "--world-size must be at most"),
        (["--global-batch", "0"], "--global-batch must be at least 1"),
        (["--top", "-3"], "--top '-3'"),  # was: every row but three
        (["--top", "0"], "--top must be at least 1"),
        (["--speedup", "nan"], "--speedup 'nan'"),
    ],
)
def test_bad_options_are_usage_errors_in_one_line(tmp_path, capsys, args, message):
    src, db = _with_probe(tmp_path)
    argv = ["plan", str(src), "--world-size", "8", "--tuning", str(db), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_input_errors_exit_1_in_one_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.py"), "--world-size", "8"]) == 1
    err = capsys.readouterr().err
    assert "missing.py" in err and len(err.strip().splitlines()) == 1
    plain = tmp_path / "plain.py"
    plain.write_text("import macrogen as mg\nX = 1\n")
    assert main(["plan", str(plain), "--world-size", "8"]) == 1
    assert "no mg.parallelize(...) to plan" in capsys.readouterr().err


def test_a_stored_probe_is_reused_only_for_its_target_and_measures():
    from macrogen.autotune.tuner import stored_probe

    probe = {"source_hash": "h", "measures": MEASURES}
    record = {"key": {"entry": ":build", "target": "cpu"}, "layout_probe": probe}
    assert stored_probe([record], "h", ":build", "cpu") is probe
    assert stored_probe([record], "h", ":build", None) is probe  # macrogen plan: any target
    assert stored_probe([record], "h", ":build", "cuda") is None
    assert stored_probe([record], "other", ":build", "cpu") is None
    old = {**record, "layout_probe": {"source_hash": "h"}}  # the resident-set probe of before
    assert stored_probe([old], "h", ":build", "cpu") is None


def test_plan_ranks_only_layouts_the_files_site_can_run(tmp_path, capsys):
    """One feasibility rule: the example's layout="auto" cannot run zero1 (its optimizer is
    not sharded for it), so plan does not recommend it, as autotune and the macro refuse it."""
    from macrogen.autotune.layouts import site_problem

    src, db = _with_probe(tmp_path, rows=512)
    assert main(["plan", str(src), "--world-size", "64", "--tuning", str(db), "--top", "500"]) == 0
    out = capsys.readouterr().out
    assert "(zero1)" not in out.split("infeasible")[0]
    assert 'dp="zero1" under layout="auto"' in out
    rows, _ = planner.plan(
        src, entry=":build", world_size=64, machine=NODES, tuning=db, global_batch=512
    )
    feasible = [r.layout for r in rows if r.step is not None]
    assert feasible
    for layout in feasible:
        assert site_problem({"layout": layout.name(), "tp_plan": {"x": "colwise"}}, 64) is None


def test_a_memory_in_bits_is_read_as_bits(tmp_path, capsys):
    """80Gb is 10 GB, as --link reads Gb/s: a 28 GB model's replicas no longer fit."""
    src, db = _with_probe(tmp_path)
    argv = ["plan", str(src), "--world-size", "8", "--tuning", str(db), "--top", "500"]
    assert main([*argv, "--gpu-memory", "800Gb"]) == 0
    assert "over 100.0 GB" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--max-trials", "0"], "--max-trials must be at least 1"),
        (["--memory-per-rank", "nan"], "--memory-per-rank 'nan'"),
        (["--timeout", "-1"], "--timeout '-1'"),
        (["--noise", "inf"], "--noise 'inf'"),
        (["--entry", "nocolon"], "--entry must be module:factory"),
    ],
)
def test_autotune_bad_usage_exits_2_as_plan_does(tmp_path, capsys, args, message):
    src, _ = _with_probe(tmp_path)
    argv = ["autotune", str(src), "--entry", ":build", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
