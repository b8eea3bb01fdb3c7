"""Issue 27's categories for the environment: variables, the cache path, CLI exit codes.

- env vars: MACROGEN_BACKEND and MACROGEN_TIMEOUT are validated, naming the
  variable; ranks started with different settings fail within MACROGEN_TIMEOUT,
  naming the rank and the setting (real processes on a TCPStore on 127.0.0.1);
- cache path: a symlink another user owns anywhere on the cache path is never
  followed; ``cache clear`` removes only what the cache wrote;
- CLI exit codes: an uncaught exception in any command is exit 3 with the
  "please report" line; a malformed database or a tuning path that is no regular
  file is a one-line error (no hang on a FIFO); the hook falls back to the
  defaults on a winner that is not one of the choices.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from macrogen import cache, hook
from macrogen.autotune import database
from macrogen.cli import main
from macrogen.commands.expand import expand_files
from macrogen.runtime import groups

REPO = Path(__file__).resolve().parent.parent
OTHER_UID = 54321  # no such user needed: lchown takes any uid (we run as root)
SOURCE = "import macrogen as mg\n\nA = mg.define(6)\n"
TUNABLE = "import macrogen as mg\nBLOCK = mg.tunable(2, choices=[1, 2, 4])\n"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (hook.DISABLE_ENV, hook.CACHE_DIR_ENV, hook.TUNING_ENV, hook.SHOW_ENV):
        monkeypatch.delenv(var, raising=False)
    for var in (groups.BACKEND_ENV, groups.TIMEOUT_ENV):
        monkeypatch.delenv(var, raising=False)
    hook._warned.clear()


def _bounded(fn, seconds: float = 30.0):
    """fn() in a thread: a hang fails the test instead of stopping the suite."""
    result: dict = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the test
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s (a hang)"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _load(source: Path, **options) -> tuple[dict, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = hook.load(source, source.stem, hook.options(**options))
    namespace: dict = {}
    exec(code, namespace)
    return namespace, err.getvalue()


# == env vars ================================================================================
@pytest.mark.parametrize("bad", ["nonsense", "glo", "cpu:gloo,cuda:nonsense", ":gloo", "gloo,"])
def test_a_backend_torch_does_not_know_is_an_error_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(groups.BACKEND_ENV, bad)
    with pytest.raises(ValueError) as info:
        groups.placement()
    message = str(info.value)
    assert message.startswith(f"MACROGEN_BACKEND={bad!r}:") and "expected one of gloo" in message
    assert "cpu:gloo,cuda:nccl" in message  # and what else is accepted


def test_launch_reports_a_bad_backend_before_torch_does(monkeypatch):
    from macrogen.runtime import launch

    monkeypatch.setenv(groups.BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match="MACROGEN_BACKEND='nonsense'"):
        launch.launch()


@pytest.mark.parametrize("good", ["gloo", "GLOO", " auto ", "cpu:gloo", "cpu:gloo,cuda:nccl"])
def test_backends_torch_knows_are_accepted(monkeypatch, good):
    monkeypatch.setenv(groups.BACKEND_ENV, good)
    monkeypatch.setattr(groups.torch.cuda, "is_available", lambda: False)
    if "nccl" in good:
        with pytest.raises(ValueError, match="no usable GPU"):  # the old check, not "unknown"
            groups.placement()
    else:
        assert groups.placement().device == "cpu"


@pytest.mark.parametrize("bad", ["1e14", "1e300", "31536001", "-0", "nan"])
def test_a_timeout_out_of_range_is_an_error_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(groups.TIMEOUT_ENV, bad)
    with pytest.raises(ValueError) as info:  # not OverflowError from timedelta
        groups.timeout()
    assert str(info.value).startswith(f"MACROGEN_TIMEOUT={bad!r}: expected a positive number")
    assert "at most 31536000" in str(info.value)


def test_a_timeout_of_a_year_is_accepted(monkeypatch):
    monkeypatch.setenv(groups.TIMEOUT_ENV, "31536000")
    assert groups.timeout().days == 365


START = textwrap.dedent(
    """\
    import time
    from macrogen.runtime import groups
    started = time.monotonic()
    try:
        groups.ensure_initialized()
        print("started", groups.world_size())
    except groups.StartupError as e:
        print("StartupError:", e)
    print(f"elapsed {time.monotonic() - started:.1f}")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(world_sizes: list[int], limit: str) -> list[tuple[str, float]]:
    """Start one process per entry (RANK = index, WORLD_SIZE = the entry); (output, start-up s)."""
    port = _free_port()
    procs = []
    for rank, world in enumerate(world_sizes):
        env = dict(
            os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MACROGEN_TIMEOUT=limit,
        )  # fmt: skip
        env.pop("MACROGEN_BACKEND", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", START],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    results = []
    try:
        for p in procs:
            out = p.communicate(timeout=90)[0]  # before the fix: about 100 s with 20
            elapsed = float(out.rsplit("elapsed ", 1)[1].split()[0])
            results.append((out, elapsed))
    finally:
        for p in procs:
            p.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[2, 3], [3, 2]])
def test_ranks_with_different_world_sizes_fail_at_once_naming_rank_and_setting(sizes):
    results = _start_ranks(sizes, "20")
    expected = (
        f"ranks were started with different WORLD_SIZE: rank 0 has WORLD_SIZE={sizes[0]},"
        f" rank 1 has WORLD_SIZE={sizes[1]}"
    )
    for rank, (out, elapsed) in enumerate(results):
        assert f"StartupError: rank {rank}: {expected}" in out, out
        assert elapsed < 20, out  # within MACROGEN_TIMEOUT (in fact at once)


@pytest.mark.slow
def test_a_rank_whose_peer_never_starts_fails_within_the_timeout():
    ((out, elapsed),) = _start_ranks([2], "2")  # rank 0 of 2 alone
    assert "StartupError: rank 0: rank 1 of WORLD_SIZE=2 did not start within 2 s" in out, out
    assert elapsed < 6, out


# == cache path ==============================================================================
@pytest.fixture
def shared():
    """A sticky, world-writable cache root, as /tmp is."""
    folder = Path(tempfile.mkdtemp(prefix="mg-shared-"))
    folder.chmod(0o1777)
    yield folder
    for path in sorted(folder.rglob("*"), reverse=True):  # links first, never through them
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            path.rmdir()
    folder.rmdir()


def _first_mirrored(source: Path, cache_dir: Path) -> Path:
    return cache_dir / source.parent.relative_to(source.parent.anchor).parts[0]


def test_another_users_link_for_the_first_mirrored_folder_is_not_followed(shared, tmp_path):
    source = tmp_path / "victim.py"
    source.write_text(SOURCE)
    chosen = tmp_path / "chosen"  # where they want our entries: a folder we own
    chosen.mkdir(mode=0o700)
    link = _first_mirrored(source, shared)
    link.symlink_to(chosen)
    os.lchown(link, OTHER_UID, OTHER_UID)
    namespace, err = _load(source, cache_dir=shared)
    assert namespace["A"] == 6
    assert f"{link} is a symbolic link that belongs to another user" in err
    assert list(chosen.rglob("*")) == []  # nothing written where they chose


def test_another_users_link_deeper_on_the_cache_path_is_not_followed(shared, tmp_path):
    source = tmp_path / "deep.py"
    source.write_text(SOURCE)
    where = cache.locate(source, target=None, cache_dir=shared)
    chosen = tmp_path / "chosen"
    chosen.mkdir(mode=0o700)
    where.entry.parent.parent.mkdir(parents=True, mode=0o700)
    os.chmod(_first_mirrored(source, shared), 0o700)
    where.entry.parent.symlink_to(chosen)
    os.lchown(where.entry.parent, OTHER_UID, OTHER_UID)
    _, err = _load(source, cache_dir=shared)
    assert "is a symbolic link that belongs to another user" in err
    assert list(chosen.iterdir()) == []


def test_write_checks_the_path_again_after_making_the_folders(shared, tmp_path):
    """A link planted between the hook's check and the write: refused, nothing written."""
    source = tmp_path / "race.py"
    source.write_text(SOURCE)
    where = cache.locate(source, target=None, cache_dir=shared)
    chosen = tmp_path / "chosen"
    chosen.mkdir(mode=0o700)
    link = _first_mirrored(source, shared)
    link.symlink_to(chosen)
    os.lchown(link, OTHER_UID, OTHER_UID)
    entry = cache.Entry(compile(SOURCE, str(source), "exec"), None, ())
    with pytest.raises(OSError, match="belongs to another user"):
        cache.write(where, b"k" * 32, entry, cache_dir=shared)
    assert not any(p.is_file() for p in chosen.rglob("*"))


def test_a_link_of_ones_own_on_the_cache_path_is_followed(tmp_path):
    source = tmp_path / "src" / "mine.py"
    source.parent.mkdir()
    source.write_text(SOURCE)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    _first_mirrored(source, root).symlink_to(real)
    _, err = _load(source, cache_dir=root)
    assert err == ""
    assert list(real.rglob("*.mgc"))  # written through our own link
    hook._records.clear()
    _load(source, cache_dir=root)
    assert hook.records()[-1].cache == "hit"


def _clear(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["cache", *args])
    return status, out.getvalue()


def test_cache_clear_on_a_tree_keeps_a_users_files_named_like_entries(tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    own = tree / "sub" / "train.macrogen-cpu.py"
    own.write_text("print('my own file')\n")
    lookalike = tree / "sub" / f"train.macrogen-cpu.{sys.implementation.cache_tag}.mgc"
    lookalike.write_bytes(b"my notes, not an entry")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _clear("info", str(empty), "--cache-dir", str(tree)) == (0, "0 files, 0 B\n")
    assert _clear("clear", str(empty), "--cache-dir", str(tree)) == (0, "removed 0 files (0 B)\n")
    assert own.read_text() == "print('my own file')\n" and lookalike.exists()


def test_cache_clear_removes_what_the_cache_wrote_and_nothing_beside_it(tmp_path):
    source = tmp_path / "src" / "train.py"
    source.parent.mkdir()
    source.write_text(SOURCE)
    store = tmp_path / "store"
    _load(source, cache_dir=store)
    where = cache.locate(source, target=None, cache_dir=store)
    mine = where.entry.parent / "train.macrogen-cpu.py"  # the user's, beside real entries
    mine.write_text("print('mine')\n")
    dead = where.entry.parent / f".{where.entry.name}.macrogen-999999999-abc.tmp"  # killed write
    live = where.entry.parent / f".{where.expanded.name}.macrogen-{os.getpid()}-abc.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    status, out = _clear("clear", str(source.parent), "--cache-dir", str(store))
    assert (status, out.split(" (")[0]) == (0, "removed 3 files")
    assert sorted(p.name for p in where.entry.parent.iterdir()) == sorted([mine.name, live.name])


# == CLI exit codes ==========================================================================
COMMANDS = {
    "expand": ["expand", "x.py"],
    "run": ["run", "x.py"],
    "cache": ["cache", "info"],
    "autotune": ["autotune", "x.py", "--entry", ":f"],
    "checkpoint": ["checkpoint", "list", "x"],
    "plan": ["plan", "x.py", "--world-size", "2"],
    "verify": ["verify", "x.py", "--entry", ":f", "--world-size", "2"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_uncaught_exception_in_any_command_is_exit_3_with_the_report_line(
    command, monkeypatch, capsys
):
    import importlib

    module = importlib.import_module(f"macrogen.commands.{command}")

    def broken(args):
        return {}["candidates"]  # a KeyError deep in a command

    monkeypatch.setattr(module, "run", broken)
    assert main(COMMANDS[command]) == 3
    err = capsys.readouterr().err
    assert f"macrogen {command}: internal error (a macrogen bug, please report it):" in err
    assert "KeyError: 'candidates'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_every_command_is_in_this_test():
    import pkgutil

    import macrogen.commands as commands

    assert {m.name for m in pkgutil.iter_modules(commands.__path__)} == set(COMMANDS)


def _db(*records) -> str:
    return json.dumps({"format": "macrogen-tuning", "version": 2, "records": list(records)})


def test_a_record_without_candidates_is_a_record_with_none_measured(tmp_path):
    from macrogen.autotune import space
    from macrogen.autotune.measure import Measurement
    from macrogen.autotune.tuner import _Book

    path = tmp_path / "tuning.json"
    key = {"file": "p.py", "params": ["X"]}  # no "signature" either
    path.write_text(_db({"key": key, "generation": 1, "winner": {"X": 1}}))
    cspace = space.build(
        (space.Parameter("X", 1, (1, 2), None, None),), space.TuningEnv("cpu", 1, "cpu")
    )
    book = _Book(database.Database(path), key, "source", cspace, retry_failed=True)
    assert book.known({"X": 1}) is None and book.winner() is None
    book.record(Measurement({"X": 2}, time_s=1.0, samples=3, signature={"x": [2]}))
    assert book.winner() == {"X": 2}
    saved = json.loads(path.read_text())["records"][0]
    assert [c["values"] for c in saved["candidates"]] == [{"X": 2}]


@pytest.fixture
def tunable(tmp_path) -> Path:
    src = tmp_path / "m.py"
    src.write_text(TUNABLE + "\n\ndef f(module):\n    return lambda: None\n")
    return src


def _autotune(src: Path, tuning: Path, capsys) -> tuple[int, str]:
    argv = ["autotune", str(src), "--entry", ":f", "--target", "cpu", "--tuning", str(tuning)]
    status = _bounded(lambda: main(argv))
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"key": {"file": "m.py"}, "candidates": [{"values": {"BLOCK": 1}, "error": 5}]}, '"error" must be a string'),
        ({"key": {"file": "m.py", "signature": []}}, '"key"."signature" must be an object'),
        ({"key": {"file": "m.py"}, "candidates": 3}, '"candidates" must be a list'),
    ],
)  # fmt: skip
def test_autotune_on_a_malformed_record_is_exit_1_naming_the_file(
    tunable, tmp_path, capsys, record, message
):
    db = tmp_path / "tuning.json"
    db.write_text(_db(record))
    status, err = _autotune(tunable, db, capsys)
    assert status == 1 and f"{db}: record 1 of 1: {message}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_autotune_on_a_fifo_says_so_and_does_not_hang(tunable, tmp_path, capsys):
    fifo = tmp_path / "tuning.json"
    os.mkfifo(fifo)
    status, err = _autotune(tunable, fifo, capsys)
    assert status == 1 and f"{fifo}: a FIFO (named pipe), not a regular file" in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left as it was


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing"])
def test_expand_tuning_says_what_the_path_is(tmp_path, kind):
    src = tmp_path / "m.py"
    src.write_text(TUNABLE)
    path = tmp_path / "tuning"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    err = io.StringIO()
    status = _bounded(
        lambda: expand_files([str(src)], tuning=str(path), stdout=io.BytesIO(), stderr=err)
    )
    expected = {
        "fifo": "a FIFO (named pipe), not a regular file",
        "directory": "a directory, not a regular file",
        "missing": "no such file",
    }[kind]
    assert (status, err.getvalue()) == (2, f"macrogen expand: error: --tuning {path}: {expected}\n")


def test_the_hook_with_a_fifo_for_a_database_warns_and_does_not_hang(tmp_path):
    src = tmp_path / "fifo_m.py"
    src.write_text(TUNABLE)
    os.mkfifo(tmp_path / hook.TUNING_FILE)
    namespace, err = _bounded(lambda: _load(src, cache_dir=tmp_path / "cache"))
    assert namespace["BLOCK"] == 2
    assert (
        f"can't use the tuning database {tmp_path / hook.TUNING_FILE} (not a regular file)" in err
    )


def test_the_hook_on_a_winner_not_in_choices_warns_and_uses_the_defaults(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(TUNABLE)
    db = tmp_path / hook.TUNING_FILE
    record = {
        "key": {"file": "m.py", "target": "cpu"},
        "generation": 1,
        "source_hash": database.source_hash(TUNABLE),
        "candidates": [],
        "winner": {"BLOCK": 3},
    }
    db.write_text(_db(record))
    for status in ("missing", "hit"):  # cold, then warm: the warning both times
        hook._warned.clear()
        namespace, err = _load(src, cache_dir=tmp_path / "cache")
        assert namespace["BLOCK"] == 2 and hook.records()[-1].cache == status
        assert f"can't use the tuning database {db} at {src}:2:" in err, err
        assert "chose 3 for 'BLOCK', which is not one of its choices [1, 2, 4]" in err
        assert "using the defaults for this file" in err


def test_the_hook_still_reports_the_programs_own_errors_with_a_database(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(TUNABLE + "C = mg.defne(2)\n")
    db = tmp_path / hook.TUNING_FILE
    db.write_text(_db({"key": {"file": "m.py"}, "source_hash": database.source_hash(src.read_text()), "winner": {"BLOCK": 3}}))  # fmt: skip
    with pytest.raises(hook.MacroExpansionError, match="defne"):
        _load(src, cache_dir=tmp_path / "cache")
