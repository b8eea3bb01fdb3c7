"""``macrogen autotune`` on one CPU process: measuring, failures, re-runs and resumption.

Each test writes a small annotated program (and an entry module) to a
temporary directory; candidates are timed by real worker processes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from macrogen import cli
from macrogen.autotune import database
from macrogen.autotune.measure import Timing
from macrogen.autotune.report import Reporter
from macrogen.autotune.tuner import autotune

FAST = Timing(warmup=1, min_time=0.02, timeout=60)


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def _quiet() -> tuple[Reporter, io.StringIO]:
    out = io.StringIO()
    return Reporter(Console(file=out, width=200), Console(file=io.StringIO())), out


def _candidates(db: Path) -> dict[str, dict]:
    records = json.loads(db.read_text())["records"]
    return {json.dumps(c["values"], sort_keys=True): c for r in records for c in r["candidates"]}


@pytest.mark.slow
def test_failures_are_recorded_and_tuning_goes_on(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        "prog.py",
        """\
        import os
        import time

        import torch

        import macrogen as mg

        SIZE = mg.tunable(16, choices=[16, 1, 2, 32, 3])


        def make_step():
            if SIZE == 1:
                raise ValueError("no good size")
            if SIZE == 2:
                os._exit(3)  # the whole worker dies
            if SIZE == 3:
                time.sleep(60)  # hangs: the per-candidate timeout ends it
            a = torch.randn(SIZE, SIZE)
            return (lambda: a @ a), {"dtype": "float32", "n": 4}
        """,
    )
    reporter, out = _quiet()
    timing = Timing(warmup=1, min_time=0.02, timeout=3)
    outcome = autotune(src, entry=":make_step", target="cpu", timing=timing, reporter=reporter)
    db = database.default_path(src)
    assert outcome.database == db and outcome.strategy == "exhaustive"
    assert outcome.new_measurements == 5 and outcome.stopped == "complete"
    assert outcome.winner in ({"SIZE": 16}, {"SIZE": 32})
    results = {json.loads(k)["SIZE"]: c for k, c in _candidates(db).items()}
    assert results[16]["time_s"] > 0 and results[32]["time_s"] > 0
    assert results[1]["error"].startswith("the entry factory raised ValueError: no good size")
    assert "prog.py:13 in make_step" in results[1]["error"]
    assert results[2]["error"].startswith("the worker exited with status")
    assert results[3]["error"] == "timed out after 3 s"
    record = json.loads(db.read_text())["records"][0]
    assert record["key"]["signature"] == {"dtype": "float32", "n": 4}
    assert record["key"]["params"] == ["SIZE"] and record["key"]["world_size"] == 1
    assert set(record["environment"]) >= {"python", "torch", "platform"}
    table = out.getvalue()
    assert "winner" in table and "failed" in table and "timed out" in table

    # Unchanged file and entry: nothing is measured again, failures included.
    started = time.monotonic()
    again = autotune(src, entry=":make_step", target="cpu", timing=timing, reporter=_quiet()[0])
    assert again.new_measurements == 0 and again.winner == outcome.winner
    assert time.monotonic() - started < 5  # no worker was launched


@pytest.mark.slow
def test_entry_that_fails_to_import_then_is_fixed(tmp_path: Path, capsys) -> None:
    src = _write(
        tmp_path,
        "prog.py",
        """\
        import torch

        import macrogen as mg

        SIZE = mg.tunable(8, choices=[8, 16])
        """,
    )
    _write(tmp_path, "entry.py", "import no_such_module_here\n")
    db = tmp_path / "tuning.json"
    argv = ["autotune", str(src), "--entry", "entry:make_step", "--tuning", str(db)]
    argv += ["--target", "cpu", "--min-time", "0.02", "--warmup", "1"]
    assert cli.main(argv) == 1  # no winner: every candidate failed
    errors = [c["error"] for c in _candidates(db).values()]
    assert len(errors) == 2 and all(
        e.startswith("importing the entry module 'entry' failed: ModuleNotFoundError")
        for e in errors
    )
    assert ": none (every candidate failed" in capsys.readouterr().out  # "winner [on KIND]: none"

    # A fixed entry is another key (its hash): both candidates are measured now.
    _write(
        tmp_path,
        "entry.py",
        """\
        import torch


        def make_step(module):
            a = torch.randn(module.SIZE, module.SIZE)
            return lambda: a @ a
        """,
    )
    assert cli.main(argv) == 0
    records = json.loads(db.read_text())["records"]
    assert len(records) == 2
    fixed = max(records, key=lambda r: r["generation"])
    assert all("time_s" in c for c in fixed["candidates"]) and len(fixed["candidates"]) == 2
    assert database.winners(db, src.read_text(), file="prog.py")[0] == database.decode_values(
        fixed["winner"]
    )


def test_bad_requests_are_one_line_errors(tmp_path: Path, capsys) -> None:
    src = _write(tmp_path, "prog.py", "import macrogen as mg\n\nX = 1\n")
    assert cli.main(["autotune", str(src), "--entry", ":make_step", "--target", "cpu"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"macrogen autotune: error: {src}: no tunable(...) to tune"
    )
    bad_entry = ["autotune", str(src), "--entry", "make_step", "--target", "cpu"]
    assert cli.main(bad_entry) == 2  # bad usage, as plan
    assert "--entry must be module:factory" in capsys.readouterr().err
    bad = _write(tmp_path, "bad.py", "import macrogen as mg\n\nX = mg.tunable(1, choices=[2])\n")
    assert cli.main(["autotune", str(bad), "--entry", ":f", "--target", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bad.py:3:") and "error: the default 1 is not one of the choices" in err


@pytest.mark.slow
def test_a_killed_run_resumes_without_repeating_candidates(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        "prog.py",
        """\
        import time

        import torch

        import macrogen as mg

        SIZE = mg.tunable(8, choices=[8, 16, 24, 32])


        def make_step():
            if SIZE != 8:
                time.sleep(0.8)  # slow enough to be killed between candidates
            a = torch.randn(SIZE, SIZE)
            return lambda: a @ a
        """,
    )
    db = database.default_path(src)
    cmd = [sys.executable, "-m", "macrogen", "autotune", str(src), "--entry", ":make_step"]
    cmd += ["--target", "cpu", "--min-time", "0.02", "--warmup", "1", "--group", "1"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (db.exists() and _candidates(db)):
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = _candidates(db)
    assert 1 <= len(before) < 4, "killed after the first measurement, before the last"

    outcome = autotune(src, entry=":make_step", target="cpu", timing=FAST, reporter=_quiet()[0])
    after = _candidates(db)
    assert outcome.new_measurements == 4 - len(before)
    assert len(after) == 4 and all(after[k] == c for k, c in before.items())

    # Adding a choice keeps the measurements: only the new candidate is measured.
    src.write_text(src.read_text().replace("[8, 16, 24, 32]", "[8, 16, 24, 32, 4]"))
    grown = autotune(src, entry=":make_step", target="cpu", timing=FAST, reporter=_quiet()[0])
    assert grown.new_measurements == 1 and len(_candidates(db)) == 5
    values, stale = database.winners(db, src.read_text(), file="prog.py")
    assert values == grown.winner and stale == []


TILE = """\
import torch

import macrogen as mg


@mg.tile(i=mg.tunable(32, choices=[16, 32]), j=mg.tunable(32, choices=[32, 64]))
def bias_gelu(out, x, b):
    M, N = x.shape
    for i in range(M):
        for j in range(N):
            v = x[i, j] + b[j]
            out[i, j] = v * torch.sigmoid(1.702 * v)


def make_step():
    x = torch.randn(64, 96)
    b = torch.randn(96)
    out = torch.empty_like(x)
    return (lambda: bias_gelu(out, x, b)), {"dtype": "float32", "x": [64, 96]}
"""


@pytest.mark.slow
def test_tile_sizes_tune_on_the_cpu_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the worker times the torch path all the same
    src = _write(tmp_path, "kern.py", TILE)
    outcome = autotune(src, entry=":make_step", target="cpu", timing=FAST, reporter=_quiet()[0])
    assert [(p.key, p.macro) for p in outcome.space.parameters] == [
        ("bias_gelu.i", "tile"),
        ("bias_gelu.j", "tile"),
    ]
    assert outcome.new_measurements == 4 and outcome.winner is not None
    assert all("time_s" in c for c in _candidates(database.default_path(src)).values())
    out, err = io.BytesIO(), io.StringIO()
    from macrogen.commands.expand import expand_files

    assert expand_files([str(src)], stdout=out, stderr=err) == 0, err.getvalue()
    header = out.getvalue().decode()
    for key, value in outcome.winner.items():
        assert f"# tunable {key} = {value} (tuned;" in header


def test_cuda_candidates_are_timed_with_do_bench(monkeypatch) -> None:
    """The CUDA path runs where a GPU exists; here: that it is chosen and what it reports."""
    import triton.testing

    from macrogen.autotune import worker
    from macrogen.autotune.measure import Program

    program = Program(Path("k.py"), "", ":f", True, 1, "cuda", FAST)
    assert program.mode() == "do_bench"
    assert Program(Path("k.py"), "", ":f", True, 2, "cuda", FAST).mode() == "ranks"
    assert Program(Path("k.py"), "", ":f", True, 1, "cpu", FAST).mode() == "benchmark"
    calls = []

    def fake_do_bench(fn, warmup, rep, quantiles):
        calls.append((warmup, rep, quantiles))
        fn()
        return [1.0, 2.0, 3.0]  # milliseconds

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    ran = []
    times = worker.TIMERS["do_bench"](lambda: ran.append(1), {"min_time": 0.4, "rounds": 4})
    assert times == [0.001, 0.002, 0.003] and ran == [1]
    assert calls == [(26, 100, [0.2, 0.5, 0.8])]


@pytest.mark.slow
def test_a_budget_stops_the_run_and_the_next_run_goes_on(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        "prog.py",
        """\
        import time

        import torch

        import macrogen as mg

        SIZE = mg.tunable(8, choices=[8, 16, 24, 32])


        def make_step():
            time.sleep(0.6)
            a = torch.randn(SIZE, SIZE)
            return lambda: a @ a
        """,
    )
    timing = Timing(warmup=1, min_time=0.02, group=2, timeout=60)
    started = time.monotonic()
    first = autotune(
        src, entry=":make_step", target="cpu", budget=4, timing=timing, reporter=_quiet()[0]
    )
    assert time.monotonic() - started < 4 + 2
    assert first.stopped == "budget" and first.new_measurements < 4
    rest = autotune(src, entry=":make_step", target="cpu", timing=timing, reporter=_quiet()[0])
    assert rest.stopped == "complete"
    assert first.new_measurements + rest.new_measurements == 4
    assert len(_candidates(database.default_path(src))) == 4


@pytest.mark.slow
def test_a_large_space_is_sampled_and_a_rerun_measures_nothing(tmp_path: Path) -> None:
    src = _write(
        tmp_path,
        "prog.py",
        """\
        import torch

        import macrogen as mg

        ROWS = mg.tunable(8, choices=[8, 16, 24, 32])
        COLS = mg.tunable(8, choices=[8, 16, 24])


        def make_step():
            a = torch.randn(ROWS, COLS)
            return lambda: a @ a.T
        """,
    )
    first = autotune(
        src, entry=":make_step", target="cpu", max_trials=4, timing=FAST, reporter=_quiet()[0]
    )
    assert first.strategy == "random" and first.planned == 4
    assert 1 <= first.new_measurements <= 4
    assert first.stopped in ("max trials", "early stop")
    measured = _candidates(database.default_path(src))
    assert json.dumps({"COLS": 8, "ROWS": 8}) in measured  # the defaults come first
    again = autotune(
        src, entry=":make_step", target="cpu", max_trials=4, timing=FAST, reporter=_quiet()[0]
    )
    assert again.new_measurements == 0 and again.winner == first.winner


def test_retry_failed_measures_failures_again(tmp_path: Path) -> None:
    from macrogen.autotune import space
    from macrogen.autotune.measure import Measurement
    from macrogen.autotune.tuner import _Book

    params = (space.Parameter("X", 1, (1, 2), None, None),)
    cspace = space.build(params, space.TuningEnv("cpu", 1, "cpu"))
    db = database.Database(tmp_path / "tuning.json")
    key = {"file": "p.py", "params": ["X"], "signature": {}}
    book = _Book(db, key, "source", cspace, retry_failed=False)
    book.record(Measurement({"X": 1}, time_s=2.0, samples=3))
    book.record(Measurement({"X": 2}, error="boom"))
    assert book.winner() == {"X": 1}
    assert _Book(db, key, "source", cspace, False).known({"X": 2})["error"] == "boom"
    retry = _Book(db, key, "source", cspace, retry_failed=True)
    assert retry.known({"X": 2}) is None and retry.known({"X": 1}) is not None
    retry.record(Measurement({"X": 2}, time_s=1.0, samples=3))
    assert retry.known({"X": 2})["time_s"] == 1.0 and retry.winner() == {"X": 2}
    saved = json.loads((tmp_path / "tuning.json").read_text())["records"][0]
    assert saved["winner"] == {"X": 2} and len(saved["candidates"]) == 2


def test_a_candidate_its_macro_rejects_is_recorded_failed_without_a_run() -> None:
    from macrogen.autotune.measure import Measurement, Program, measure

    source = textwrap.dedent(
        """\
        import macrogen as mg


        @mg.tile(i=mg.tunable(32, choices=[32, 48]))
        def scale(out, x):
            (N,) = x.shape
            for i in range(N):
                out[i] = 2.0 * x[i]
        """
    )
    program = Program(Path("t.py"), source, ":make_step", True, 1, "cpu", FAST)
    got: list[Measurement] = []
    assert measure(program, [{"scale.i": 48}], lambda m: got.append(m) or True) == "complete"
    assert got == [
        Measurement(
            {"scale.i": 48},
            error="expansion failed: the tile size of 'i' must be a power of two, not 48",
        )
    ]


@pytest.mark.slow
def test_the_worker_takes_the_order_the_search_gives_after_each_result(tmp_path: Path) -> None:
    """A search that re-ranks as it learns (layouts: the fitted cost model) hands ``reorder``
    to measure(); the worker, between candidates, takes the order written after its last
    result: here ascending and descending in turns, so only a live order gives 5 1 4 2 3
    (4 kills its worker: the new launch starts in the order after that failure, 2 then 3)."""
    from macrogen.autotune.measure import Measurement, Program, measure

    source = textwrap.dedent(
        """\
        import os

        import torch

        import macrogen as mg

        SIZE = mg.tunable(1, choices=[1, 2, 3, 4, 5])


        def make_step():
            if SIZE == 4:
                os._exit(3)  # the worker dies: the rest go on in a new launch, in the order
            a = torch.randn(SIZE, SIZE)
            return lambda: a @ a
        """
    )
    src = _write(tmp_path, "order.py", source)
    timing = Timing(warmup=1, min_time=0.02, timeout=60, group=1, rounds=1)
    program = Program(src, source, ":make_step", True, 1, "cpu", timing)
    got: list[Measurement] = []

    def reorder(pending: list[dict]) -> list[dict]:
        return sorted(pending, key=lambda v: v["SIZE"], reverse=len(got) % 2 == 0)

    candidates = [{"SIZE": n} for n in range(1, 6)]
    assert measure(program, candidates, lambda m: got.append(m) or True, reorder=reorder) == (
        "complete"
    )
    assert [m.values["SIZE"] for m in got] == [5, 1, 4, 2, 3]
    assert [m.error is None for m in got] == [True, True, False, True, True]


def test_a_stopped_launch_leaves_no_rank_running(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: a search that stops (early stopping,
    a timeout) must end the ranks too, or they go on measuring beside the next launch."""
    from macrogen.autotune.measure import Measurement, Program, measure

    pids = tmp_path / "pids"
    pids.mkdir()
    source = textwrap.dedent(
        f"""\
        import os
        import time

        import macrogen as mg

        SIZE = mg.tunable(1, choices=[1, 2, 3, 4])


        def make_step():
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            # the first is quick; the next would keep an orphaned rank busy for 20 s
            return lambda: time.sleep(0.001 if SIZE == 1 else 0.5)
        """
    )
    src = _write(tmp_path, "stopped.py", source)
    timing = Timing(warmup=1, min_time=0.02, timeout=60, group=1, rounds=1, steps=40)
    program = Program(src, source, ":make_step", True, 2, "cpu", timing)
    got: list[Measurement] = []
    candidates = [{"SIZE": n} for n in range(1, 5)]

    def stop(m: Measurement) -> bool:
        got.append(m)
        time.sleep(3)  # the ranks meanwhile go on into the next candidate's 20 s of steps
        return False

    assert measure(program, candidates, stop) == "stopped"
    assert len(got) == 1 and got[0].error is None
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(set(ranks)) == 2  # both ranks built the first candidate

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie waits for its reaper: it measures nothing

    deadline = time.monotonic() + 5
    while any(running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in ranks)
