"""The tuning database: its format, its keys, and how ``expand`` follows it."""

from __future__ import annotations

import difflib
import io
import json
import re
import textwrap
from pathlib import Path

import pytest

from macrogen.autotune import database
from macrogen.commands.expand import expand_files

PROGRAM = textwrap.dedent(
    """\
    import torch.distributed as dist
    import macrogen as mg

    BLOCK = mg.tunable(64, choices=[32, 64, 128])
    WIDTH = mg.tunable(8, choices=[4, 8])
    OTHER = mg.tunable("a", choices=["a", "b"])


    def sync(a, b):
        with mg.fused_allreduce(block=mg.tunable(1024, choices=[256, 1024])):
            dist.all_reduce(a)
            dist.all_reduce(b)
    """
)


def _record(db: database.Database, source: str, winner: dict, *, target="cpu", file="prog.py"):
    key = {
        "device": {"kind": target, "name": "test"},
        "entry": ":make_step",
        "entry_hash": "",
        "file": file,
        "macrogen": "0.1.0",
        "params": sorted(winner),
        "signature": {},
        "site_hash": database.site_hash(source),
        "target": target,
        "world_size": 1,
    }
    record = db.new_record(key, {"python": "3"})
    record["candidates"] = [{"values": database.encode_values(winner), "time_s": 1.0, "samples": 3}]
    record["winner"] = database.encode_values(winner)
    record["source_hash"] = database.source_hash(source)
    return record


def test_site_hash_ignores_choices_but_not_the_program() -> None:
    more_choices = PROGRAM.replace("choices=[32, 64, 128]", "choices=[16, 32, 64, 128]")
    new_default = PROGRAM.replace("tunable(8,", "tunable(4,")
    edited = PROGRAM.replace("dist.all_reduce(b)", "dist.all_reduce(b, group=None)")
    assert database.site_hash(more_choices) == database.site_hash(PROGRAM)
    assert database.site_hash(new_default) == database.site_hash(PROGRAM)
    assert database.site_hash(edited) != database.site_hash(PROGRAM)
    assert database.source_hash(more_choices) != database.source_hash(PROGRAM)
    aliased = "from macrogen import tunable as tn\nX = tn(1, choices=[1, 2])\n"
    assert database.site_hash(aliased) == database.site_hash(aliased.replace("[1, 2]", "[1, 3]"))


def test_values_round_trip_through_json() -> None:
    values = {"a": 1, "b": 2.5, "c": "x", "d": None, "e": True, "f": (32, 64), "g": [1, 2]}
    encoded = json.loads(json.dumps(database.encode_values(values)))
    assert database.decode_values(encoded) == values
    assert encoded["f"] == {"python": "(32, 64)"}
    assert database.canonical({"b": 1, "a": 2}) == database.canonical({"a": 2, "b": 1})


def test_file_is_sorted_indented_json_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    db = database.Database(path)
    _record(db, PROGRAM, {"BLOCK": 128})
    _record(db, PROGRAM, {"BLOCK": 32}, file="a.py")
    db.save()
    text = path.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert [r["key"]["file"] for r in data["records"]] == ["a.py", "prog.py"]
    assert database.Database(path).data == data
    assert not list(tmp_path.glob(".*tmp")), "the write is atomic: no temporary file is left"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"records": []}', "not a macrogen tuning database"),
        ('{"format": "macrogen-tuning", "version": 1, "records": []}', "version 1"),
    ],
)
def test_a_bad_file_is_an_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        database.load(path)


def test_winners_newest_record_and_target(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    db = database.Database(path)
    _record(db, PROGRAM, {"BLOCK": 32, "WIDTH": 4})
    _record(db, PROGRAM, {"BLOCK": 128})  # tuned later: its BLOCK wins, WIDTH stays
    _record(db, PROGRAM, {"BLOCK": 64}, target="cuda")
    db.records[-1]["generation"] = 0  # an old cuda record
    db.save()
    assert database.winners(path, PROGRAM, file="prog.py", target="cpu") == (
        {"BLOCK": 128, "WIDTH": 4},
        [],
    )
    assert database.winners(path, PROGRAM, file="prog.py", target="cuda") == ({"BLOCK": 64}, [])
    assert database.winners(path, PROGRAM, file="other.py") == ({}, [])


def test_editing_the_source_makes_entries_stale(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    db = database.Database(path)
    _record(db, PROGRAM, {"BLOCK": 128, "WIDTH": 4})
    db.save()
    edited = PROGRAM.replace("dist.all_reduce(b)", "dist.all_reduce(b)  # edited")
    assert database.winners(path, edited, file="prog.py") == ({}, ["BLOCK", "WIDTH"])


def _expand(src: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.BytesIO(), io.StringIO()
    tuning = extra[0] if extra else None
    status = expand_files([str(src)], tuning=tuning, stdout=out, stderr=err)
    return status, out.getvalue().decode(), err.getvalue()


def test_expand_changes_exactly_the_tuned_literals(tmp_path: Path) -> None:
    src = tmp_path / "prog.py"
    src.write_text(PROGRAM)
    status, untuned, _ = _expand(src)
    assert status == 0
    db = database.Database(database.default_path(src))  # found without --tuning
    _record(db, PROGRAM, {"BLOCK": 128, "sync.fused_allreduce.block": 256})
    db.save()
    status, tuned, err = _expand(src)
    assert (status, err) == (0, "")
    removed, added = _changed_lines(untuned, tuned)
    # 2 header lines, BLOCK (comment, value); fused_allreduce(block=) has no effect in the code
    assert len(removed) == len(added) == 4
    tuned_literals = {"64": "128", "1024": "256"}
    for old, new in zip(removed, added):
        if old.startswith("# tunable"):  # the header and the site comment name the tuned value
            assert "default" in old and "tuned" in new
            old = old.replace("(the default)", "(tuned)").replace("(default;", "(tuned;")
        swapped = re.sub(r"\b(64|1024)\b(?!,? ?\d*\])", lambda m: tuned_literals[m[1]], old)
        assert swapped == new, (old, new)
    assert "BLOCK = 128" in added

    # An edit invalidates the entry: expand warns and uses the defaults.
    src.write_text(PROGRAM.replace("def sync(a, b):", "def sync(a, b):  # edited"))
    status, stale, err = _expand(src)
    assert status == 0
    assert "warning: tuning entry 'BLOCK' is stale" in err
    assert "BLOCK = 64\n" in stale and "# tunable BLOCK = 64 (default" in stale


def _changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), n=0))
    removed = [ln[1:].strip() for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    added = [ln[1:].strip() for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
    return removed, added


def test_a_tuple_winner_expands_as_a_tuple(tmp_path: Path) -> None:
    source = (
        "import macrogen as mg\n\nSPLIT = mg.tunable((2, 2), choices=[(1, 4), (2, 2), (4, 1)])\n"
    )
    src = tmp_path / "prog.py"
    src.write_text(source)
    db = database.Database(tmp_path / "tuning.json")
    _record(db, source, {"SPLIT": (4, 1)})
    db.save()
    status, out, err = _expand(src, str(tmp_path / "tuning.json"))
    assert (status, err) == (0, "")
    assert "\nSPLIT = (4, 1)\n" in out
