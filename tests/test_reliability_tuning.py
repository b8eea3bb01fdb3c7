"""The tuning database under concurrent writers and malformed contents; winners of the wrong type."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from macrogen.autotune import database
from macrogen.autotune.space import Parameter, TuningEnv
from macrogen.autotune.tuner import no_effect
from macrogen.commands.expand import expand_files

REPO = Path(__file__).resolve().parent.parent
SOURCE = "import macrogen as mg\nBLOCK = mg.tunable(2, choices=[1, 2, 4])\n"

WRITER = textwrap.dedent(
    """\
    import sys
    from pathlib import Path
    from macrogen.autotune import database

    path, name, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    db = database.Database(path)
    for i in range(count):
        record = db.new_record({"file": f"{name}{i}.py", "params": ["X"]}, {})
        record["winner"] = {"X": i}
        record["candidates"] = [{"values": {"X": i}, "time_s": 1.0, "samples": 1}]
        db.save()
    """
)


def test_concurrent_runs_keep_every_record(tmp_path):
    """Two runs saving into one file at once (as `autotune a.py` and `autotune b.py`)."""
    path = tmp_path / "tuning.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, "25"], env=env)
        for name in ("a", "b", "c")
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    files = sorted(r["key"]["file"] for r in database.load(path)["records"])
    assert files == sorted(f"{n}{i}.py" for n in "abc" for i in range(25))
    assert not list(tmp_path.glob(".*.tmp"))


def _db(*records) -> bytes:
    return json.dumps(
        {"format": "macrogen-tuning", "version": 2, "records": list(records)}
    ).encode()


GOOD_RECORD = {
    "key": {"file": "m.py", "target": "cpu"},
    "generation": 1,
    "source_hash": database.source_hash(SOURCE),
    "candidates": [],
    "winner": {"BLOCK": 4},
}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            _db({k: v for k, v in GOOD_RECORD.items() if k != "key"}),
            'record 1 of 1: no "key" object',
        ),
        (_db({**GOOD_RECORD, "generation": "9"}), '"generation" must be a whole number'),
        (_db({**GOOD_RECORD, "winner": [4]}), '"winner" must be an object'),
        (_db(GOOD_RECORD, 7), "record 2 of 2: a record is a JSON object"),
        (_db({**GOOD_RECORD, "winner": {"BLOCK": {"python": "(("}}}), "is not a Python literal"),
        (_db({**GOOD_RECORD, "candidates": [{"time_s": 1}]}), '"candidates" must be a list'),
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_a_malformed_database_is_an_error_naming_file_and_record(tmp_path, data, message):
    src = tmp_path / "m.py"
    src.write_text(SOURCE)
    db = tmp_path / "tuning.json"
    db.write_bytes(data)
    err = io.StringIO()
    status = expand_files([str(src)], tuning=str(db), stdout=io.BytesIO(), stderr=err)
    assert status == 1 and str(db) in err.getvalue() and message in err.getvalue(), err.getvalue()
    assert "Traceback" not in err.getvalue()


@pytest.mark.parametrize("winner", [True, 4.0, "4", [4], None])
def test_a_winner_of_another_type_is_not_a_choice(tmp_path, winner):
    src = tmp_path / "m.py"
    src.write_text(SOURCE)
    db = tmp_path / "tuning.json"
    db.write_bytes(_db({**GOOD_RECORD, "winner": {"BLOCK": winner}}))
    out, err = io.BytesIO(), io.StringIO()
    status = expand_files([str(src)], tuning=str(db), stdout=out, stderr=err)
    assert status == 1 and "not one of its choices [1, 2, 4]" in err.getvalue()
    db.write_bytes(_db({**GOOD_RECORD, "winner": {"BLOCK": 4}}))
    out = io.BytesIO()
    assert expand_files([str(src)], tuning=str(db), stdout=out, stderr=io.StringIO()) == 0
    assert b"\nBLOCK = 4\n" in out.getvalue()


def test_fused_block_is_not_tuned():
    # The fused block packs with foreach copies on every device: block sizes nothing.
    block = Parameter("sync.fused_allreduce.block", 1024, (256, 1024), "fused_allreduce", "block")
    assert "no effect" in no_effect(block, TuningEnv("cpu", 2, "cpu"))
    assert "no effect" in no_effect(block, TuningEnv("cuda", 2, "H100"))
    constant = Parameter("BLOCK", 64, (32, 64), None, None)
    assert no_effect(constant, TuningEnv("cpu", 1, "cpu")) is None
