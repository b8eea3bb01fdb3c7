"""The tuning environment as a key: records keyed by device kind, tuned per kind, looked up
by a rank for its own kind (issue 42, item 3)."""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path

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
