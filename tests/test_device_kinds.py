"""The tuning environment as a key: records keyed by device kind, tuned per kind, looked up
by a rank for its own kind (issue 42, item 3)."""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from macrogen.autotune import database, environment, tuner
from macrogen.autotune.measure import Measurement
from macrogen.autotune.report import Reporter

H100 = {"kind": "cuda", "name": "H100", "capability": "9.0", "memory": 79, "link": "nvlink x18"}
A100 = {"kind": "cuda", "name": "A100", "capability": "8.0", "memory": 39, "link": "nvlink x12"}
SOURCE = textwrap.dedent(
    """\
    import macrogen as mg

    BLOCK = mg.tunable(2, choices=[1, 2, 4])


    def make_step():
        return lambda: None
    """
)


def test_this_machines_kind_names_its_capability_memory_and_link():
    ((kind, indices),) = environment.device_kinds("cpu")
    assert set(kind) == {"kind", "name", "capability", "memory", "link"}
    assert kind["kind"] == "cpu" and kind["memory"] > 0 and indices == []


def test_a_mixed_machine_is_tuned_once_per_kind_on_its_own_devices(tmp_path, monkeypatch):
    src = tmp_path / "prog.py"
    src.write_text(SOURCE)
    monkeypatch.setattr(environment, "device_kinds", lambda target: [(H100, [0]), (A100, [1])])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen: list[tuple[str | None, int]] = []

    def fake_measure(program, candidates, on_result, *, deadline=None, reorder=None):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for values in candidates:
            seen.append((visible, values["BLOCK"]))
            # the H100 (device 0) likes 4, the A100 likes 1
            t = {"0": {1: 3.0, 2: 2.0, 4: 1.0}, "1": {1: 1.0, 2: 2.0, 4: 3.0}}[visible][
                values["BLOCK"]
            ]
            if not on_result(Measurement(values, time_s=t, samples=3)):
                return "stopped"
        return "complete"

    monkeypatch.setattr(tuner, "measure", fake_measure)
    out = io.StringIO()
    reporter = Reporter(Console(file=out, width=200), Console(file=io.StringIO()))
    db = tmp_path / "t.json"
    outcome = tuner.autotune(src, entry=":make_step", target="cpu", tuning=db, reporter=reporter)
    assert outcome.winner == {"BLOCK": 4} and outcome.device == H100
    ((other),) = outcome.others
    assert other.winner == {"BLOCK": 1} and other.device == A100
    assert {v for v, _ in seen} == {"0", "1"}  # each kind measured on its own device
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert "winner on H100: BLOCK=4" in out.getvalue()
    records = database.load(db)["records"]
    assert sorted(r["key"]["device"]["name"] for r in records) == ["A100", "H100"]
    # each rank of a mixed job resolves its own kind's winner
    for device, block in ((H100, 4), (A100, 1)):
        values, _ = database.winners(db, SOURCE, file="prog.py", device=device)
        assert values == {"BLOCK": block}
    # a kind not tuned takes one of its name first, then the newest of any
    renamed = {**A100, "memory": 79}
    assert database.winners(db, SOURCE, file="prog.py", device=renamed)[0] == {"BLOCK": 1}
    other_kind = {**H100, "name": "L40S"}
    assert database.winners(db, SOURCE, file="prog.py", device=other_kind)[0] in (
        {"BLOCK": 1},
        {"BLOCK": 4},
    )
    # a rerun measures nothing on either kind
    again = tuner.autotune(src, entry=":make_step", target="cpu", tuning=db, reporter=reporter)
    assert again.new_measurements == 0 and again.others[0].new_measurements == 0


def test_a_world_size_beyond_a_kinds_devices_is_tuned_once(tmp_path, monkeypatch):
    src = tmp_path / "prog.py"
    src.write_text(SOURCE)
    monkeypatch.setattr(environment, "device_kinds", lambda target: [(H100, [0]), (A100, [1])])

    def fake_measure(program, candidates, on_result, *, deadline=None, reorder=None):
        for values in candidates:
            on_result(Measurement(values, time_s=float(values["BLOCK"]), samples=3))
        return "complete"

    monkeypatch.setattr(tuner, "measure", fake_measure)
    quiet = Reporter(Console(file=io.StringIO()), Console(file=io.StringIO()))
    outcome = tuner.autotune(
        src, entry=":make_step", target="cpu", world_size=2, tuning=tmp_path / "t.json",
        reporter=quiet,
    )  # fmt: skip
    assert outcome.others == () and outcome.device == H100
    assert Path(tmp_path / "t.json").exists()


# -- each rank of a mixed job: its own device, its own winners ----------------------------------
MIXED = textwrap.dedent(
    """\
    import torch
    import macrogen as mg

    SCALE = mg.tunable(2, choices=[1, 2, 3])


    @mg.tile(i=mg.tunable(16, choices=[16, 32]))
    def double(out, x):
        (N,) = x.shape
        for i in range(N):
            out[i] = 2.0 * x[i]
    """
)


class _Props:
    def __init__(self, name: str, major: int, gib: int):
        self.name, self.major, self.minor, self.total_memory = name, major, 0, gib * 2**30


def _two_gpu_node(
    monkeypatch, local_rank: int, local_world_size: int = 2, backend: str | None = None
) -> None:
    """This process as rank ``local_rank`` of a node whose GPU 0 is an H100 and GPU 1 an A100."""
    import torch

    props = {0: _Props("H100", 9, 79), 1: _Props("A100", 8, 39)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world_size)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("WORLD_SIZE", str(local_world_size))
    if backend is None:
        monkeypatch.delenv("MACROGEN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MACROGEN_BACKEND", backend)


def test_a_rank_names_the_device_its_local_rank_runs_on(monkeypatch):
    for local_rank, name in ((0, "H100"), (1, "A100")):
        _two_gpu_node(monkeypatch, local_rank)
        kind = environment.rank_device(None)
        assert (kind["kind"], kind["name"]) == ("cuda", name)
        assert kind == environment.cuda_kind(local_rank)  # as autotune keys its records
    _two_gpu_node(monkeypatch, 3, local_world_size=4)  # 4 ranks share 2 GPUs: cuda:1
    assert environment.rank_device(None)["name"] == "A100"
    assert environment.rank_device("cpu")["kind"] == "cpu"  # --target cpu: the CPU's records
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert environment.rank_device(None) == environment.device_kinds("cpu")[0][0]


def _record(db: Path, source: str, device: dict, winner: dict) -> None:
    tuning = database.Database(db)
    key = {"file": "mg_mixed.py", "target": None, "params": sorted(winner), "device": device}
    record = tuning.new_record(key, {})
    record["source_hash"], record["winner"] = database.source_hash(source), winner
    tuning.save()


def _mixed_database(db: Path, monkeypatch) -> tuple[dict, dict]:
    """The H100 likes i=32 and SCALE=3; the A100 (tuned later) i=16 and SCALE=1."""
    _two_gpu_node(monkeypatch, 0)
    h100, a100 = environment.cuda_kind(0), environment.cuda_kind(1)
    _record(db, MIXED, h100, {"double.i": 32, "SCALE": 3})
    _record(db, MIXED, a100, {"double.i": 16, "SCALE": 1})
    return h100, a100


def test_database_says_which_winners_differ_by_kind(tmp_path, monkeypatch):
    db = tmp_path / "t.json"
    h100, a100 = _mixed_database(db, monkeypatch)
    records = database.file_records(db, file="mg_mixed.py")
    differ = database.differing(records, MIXED)
    assert differ == {"SCALE": [(a100, 1), (h100, 3)], "double.i": [(a100, 16), (h100, 32)]}
    assert database.kinds(records) == [a100, h100]
    assert database.kind_named(records, "h100") == h100
    one = tmp_path / "one.json"
    _record(one, MIXED, h100, {"double.i": 32, "SCALE": 3})
    assert database.differing(database.file_records(one, file="mg_mixed.py"), MIXED) == {}
    # a rank on a GPU the database has no record of takes a GPU's record, not a newer CPU's
    cpu = environment.device_kinds("cpu")[0][0]
    _record(one, MIXED, cpu, {"double.i": 16, "SCALE": 1})
    l40s = {**h100, "name": "L40S"}
    assert database.winners(one, MIXED, file="mg_mixed.py", device=l40s)[0]["SCALE"] == 3


def _mixed_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook with none of its variables set, no warning said yet, and MIXED beside a
    database of two kinds' winners."""
    from macrogen import hook

    for var in (hook.DISABLE_ENV, hook.CACHE_DIR_ENV, hook.TUNING_ENV, hook.SHOW_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(hook.TUNING_DEVICE_ENV, raising=False)
    monkeypatch.setattr(hook, "_warned", set())  # each warning said afresh in the test
    (tmp_path / "mg_mixed.py").write_text(MIXED)
    _mixed_database(tmp_path / hook.TUNING_FILE, monkeypatch)


def test_each_rank_expands_with_its_own_kinds_per_device_winners(tmp_path, monkeypatch, capsys):
    from macrogen import hook

    _mixed_hook(tmp_path, monkeypatch)
    options = hook.options()
    seen = {}
    for local_rank, name, tile in ((0, "H100", 32), (1, "A100", 16), (0, "H100", 32)):
        _two_gpu_node(monkeypatch, local_rank)
        before = len(hook.records())
        code = hook.load(tmp_path / "mg_mixed.py", "mg_mixed", options)
        (record,) = hook.records()[before:]
        namespace: dict = {}
        exec(code, namespace)
        expanded = Path(record.expanded).read_text()
        # the tile's size is this rank's kind's winner; SCALE, job-wide, the newest record's
        assert f"# tunable double.i = {tile} (tuned" in expanded, name
        assert namespace["SCALE"] == 1
        seen.setdefault(name, []).append((record.cache, record.expanded))
    # each kind has a cache entry of its own: the H100 rank's second import is a hit
    assert [cache for cache, _ in seen["H100"]] == ["missing", "hit"]
    assert seen["H100"][0][1] != seen["A100"][0][1]
    from macrogen import cache

    written = sorted(p.name for p in cache.cache_files([tmp_path]))  # what `cache clear` removes
    assert len(written) == 4 and all(name.startswith("mg_mixed.macrogen-any-") for name in written)
    err = capsys.readouterr().err
    assert (
        "tuning entry 'SCALE' differs by device kind (A100: 1, H100: 3); every rank uses 1" in err
    )
    assert "double.i" not in err


def test_the_jobs_kind_may_be_named_and_a_rank_without_a_known_device_takes_the_jobs(
    tmp_path, monkeypatch, capsys
):
    from macrogen import hook

    _mixed_hook(tmp_path, monkeypatch)

    def load(local_rank: int, local_world_size: int = 2, backend: str | None = None) -> str:
        _two_gpu_node(monkeypatch, local_rank, local_world_size, backend)
        before = len(hook.records())
        hook.load(tmp_path / "mg_mixed.py", "mg_mixed", hook.options())
        return Path(hook.records()[before:][0].expanded).read_text()

    monkeypatch.setenv(hook.TUNING_DEVICE_ENV, "H100")  # every rank: the H100's SCALE
    expanded = load(1)  # an A100 rank: its own tile, the named kind's SCALE
    assert "# tunable double.i = 16 (tuned" in expanded and "# tunable SCALE = 3 (tuned" in expanded
    assert "differs by device kind" not in capsys.readouterr().err
    monkeypatch.setenv(hook.TUNING_DEVICE_ENV, "L40S")
    assert "# tunable SCALE = 1 (tuned" in load(0)
    assert "MACROGEN_TUNING_DEVICE='L40S': no record of mg_mixed.py names it" in (
        capsys.readouterr().err
    )
    monkeypatch.delenv(hook.TUNING_DEVICE_ENV)
    expanded = load(0, local_world_size=4, backend="nccl")  # 4 ranks can't share 2 GPUs on NCCL
    assert "# tunable double.i = 16 (tuned" in expanded  # the job's (newest) value
    assert "can't tell this rank's device (MACROGEN_BACKEND='nccl'" in capsys.readouterr().err


def test_expand_says_which_tunables_differ_by_kind(tmp_path, monkeypatch):
    from macrogen.commands.expand import expand_files

    src = tmp_path / "mg_mixed.py"
    src.write_text(MIXED)
    db = tmp_path / "t.json"
    _mixed_database(db, monkeypatch)

    def run(**options):
        out, err = io.BytesIO(), io.StringIO()
        status = expand_files([str(src)], tuning=str(db), stdout=out, stderr=err, **options)
        return status, out.getvalue().decode(), err.getvalue()

    status, out, err = run()
    assert status == 0 and "# tunable double.i = 16 (tuned" in out
    (line,) = err.splitlines()
    assert line == (
        f"{src}: warning: tuning differs by device kind, and this file gives every rank one"
        " value: SCALE = 1 (A100: 1, H100: 3); double.i = 16 (A100: 16, H100: 32); --device"
        " NAME chooses the kind; the import hook (macrogen run) resolves them on each rank for"
        " its own device"
    )
    status, out, err = run(device="h100")
    assert (status, err) == (0, "") and "# tunable double.i = 32 (tuned" in out
    assert "# tunable SCALE = 3 (tuned" in out
    status, out, err = run(device="L40S")
    assert status == 2 and err == (
        "macrogen expand: error: --device 'L40S': no record of mg_mixed.py names it"
        " (recorded: 'A100', 'H100')\n"
    )


def test_target_branches_are_chosen_on_each_rank_at_run_time(monkeypatch):
    """Without --target (the import hook's default), target() is a run-time check: a rank
    with a GPU takes the cuda branch, one without the cpu branch, from one expansion."""
    import torch

    from macrogen.expand import expand_source

    source = textwrap.dedent(
        """\
        import torch
        import macrogen as mg

        if mg.target("cuda"):
            PATH = "cuda"
        else:
            PATH = "cpu"
        """
    )
    code = compile(expand_source(source).code, "prog.py", "exec")
    for available, path in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        namespace: dict = {}
        exec(code, namespace)
        assert namespace["PATH"] == path
