"""Tuning records are checked against the layout rules when they are read (issue 43, item 5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from macrogen.autotune import database
from macrogen.autotune.probe import MEASURES
from macrogen.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layout_auto.py"
KEY = "build.parallelize.layout"


def _tuned(tmp_path: Path, winner: str, *, world: int = 4, probe: bool = True) -> Path:
    """The example and a database whose record (as autotune writes it) chose ``winner``."""
    src = tmp_path / "layout_auto.py"
    shutil.copy(EXAMPLE, src)
    digest = database.source_hash(src.read_text())
    record = {
        "candidates": [{"values": {KEY: winner}, "time_s": 0.01, "samples": 3}],
        "generation": 1,
        "key": {
            "entry": ":build",
            "file": src.name,
            "params": [KEY],
            "target": "cpu",
            "world_size": world,
        },
        "source_hash": digest,
        "winner": {KEY: winner},
    }
    if probe:
        record["layout_probe"] = {
            "shape": {"blocks": 8, "divisible": {"layers.0.n_head": 6}, "rows": 16},
            "arguments": database.encode_values(
                {"layout": "tp1 pp1 replicate mb1", "tp_plan": {"layers.*.fc": "colwise"}}
            ),
            "source_hash": digest,
            "measures": MEASURES,
        }
    db = tmp_path / "macrogen_tuning.json"
    db.write_text(json.dumps({"format": "macrogen-tuning", "version": 2, "records": [record]}))
    return src


@pytest.mark.parametrize(
    "winner, world, probe, message",
    [
        # the probe says 6 heads: tp4 cannot divide them
        ("tp4 pp1 replicate mb1", 4, True, "layers.0.n_head = 6 is not divisible by tp=4"),
        # more ranks than the record's world size
        ("tp8 pp1 replicate mb1", 4, False, "tp x pp = 8 does not divide the world size 4"),
        # what layout="auto" cannot run (its optimizer is not sharded for zero1)
        ("tp1 pp1 zero1 mb1", 4, True, 'dp="zero1" under layout="auto"'),
        ("tp1 pp2 replicate mb1", 2, True, "needs at least as many micro-batches as stages"),
        ("tp9 pp1 nonsense", 4, False, "not a layout"),
        # the probe found no experts: expert parallelism has nothing to deal
        ("tp1 pp1 replicate mb1 ep2", 4, True, "ep=2 needs experts: the model is no mixture"),
        # a record without its probe: the rules above could not be checked (zero1 expanded)
        ("tp1 pp1 zero1 mb1", 4, False, 'comes without its "layout_probe"'),
        ("tp1 pp1 replicate mb1", 2, False, 'comes without its "layout_probe"'),
    ],
)
def test_expand_refuses_a_record_naming_a_layout_the_rules_refuse(
    tmp_path, capsys, winner, world, probe, message
):
    src = _tuned(tmp_path, winner, world=world, probe=probe)
    out = tmp_path / "out.py"
    assert main(["expand", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err and "record 1 of 1" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_feasible_record_expands_with_its_layout(tmp_path, capsys):
    src = _tuned(tmp_path, "tp2 pp1 fsdp mb1")
    out = tmp_path / "out.py"
    assert main(["expand", str(src), "-o", str(out)]) == 0, capsys.readouterr().err
    assert "fsdp" in out.read_text()
