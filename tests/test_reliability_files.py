"""File handling under hostile file systems: nothing partial, nothing replaced that is not a file.

A seeded generator builds source trees out of good and bad modules, read-only
files and folders, symlinks, FIFOs and unreadable folders, and runs ``expand``
over them with --out-dir, --in-place and -o. Whatever the tree, a run exits 0,
1 or 2 without a traceback; a failed run changes nothing and leaves no
temporary file; a successful one writes every expansion, writes through
symlinks and special files and never renames over them. Then: a write that
fails midway, SIGKILL mid-run, and the stale temporary files the next run
removes.
"""

from __future__ import annotations

import io
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from macrogen import files
from macrogen.commands.expand import expand_files
from macrogen.expand import expand_source

GOOD = """\
import torch.distributed as dist
import macrogen as mg

WIDTH = mg.define({n})


def sync(a, b):
    with mg.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
"""
BAD = "import macrogen as mg\n\nWIDTH = mg.defne(4)\n"
PLAIN = "x = 1\n"
REPO = Path(__file__).resolve().parent.parent
IS_ROOT = os.geteuid() == 0


def run(*sources, **options) -> tuple[int, str, bytes]:
    out, err = io.BytesIO(), io.StringIO()
    status = expand_files([str(s) for s in sources], stdout=out, stderr=err, **options)
    return status, err.getvalue(), out.getvalue()


def state(root: Path) -> dict[str, tuple]:
    """Every entry below root: its kind, mode and (for files) bytes; links not followed."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(folder) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(root))] = ("file", st.st_mode & 0o7777, p.read_bytes())
            else:
                out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777)
    return out


def temp_files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.tmp"))


# -- the generated trees ---------------------------------------------------------------------
def build_tree(rng: random.Random, root: Path) -> dict[str, str]:
    """A random source tree; returns what each *.py path holds ("good", "bad", ...)."""
    kinds: dict[str, str] = {}
    folders = [root]
    for i in range(rng.randint(1, 8)):
        folder = rng.choice(folders)
        what = rng.choice(["good", "good", "plain", "bad", "readonly", "dir", "link", "fifo",
                           "dirlink", "unreadable-dir"])  # fmt: skip
        path = folder / f"m{i}.py"
        if what in ("good", "plain", "bad", "readonly"):
            text = {
                "good": GOOD.format(n=i),
                "plain": PLAIN,
                "bad": BAD,
                "readonly": GOOD.format(n=i),
            }
            path.write_text(text[what])
            if what == "readonly":
                path.chmod(0o444)
        elif what == "dir":
            sub = folder / f"d{i}"
            sub.mkdir()
            folders.append(sub)
            continue
        elif what == "link":
            target = root / f"target{i}.txt"
            target.write_text(GOOD.format(n=i))
            path.symlink_to(target)
        elif what == "dirlink":
            (folder / f"dl{i}").symlink_to(root)
            continue
        elif what == "fifo":
            os.mkfifo(path)
        else:
            sub = folder / f"secret{i}"
            sub.mkdir()
            (sub / "s.py").write_text(GOOD.format(n=i))
            sub.chmod(0)
        kinds[str(path.relative_to(root))] = what
    return kinds


def _unreadable(e: OSError) -> None:
    raise e


@pytest.mark.parametrize("seed", range(40))
def test_generated_trees(tmp_path, seed, monkeypatch):
    rng = random.Random(seed)
    src = tmp_path / "src"
    src.mkdir()
    kinds = build_tree(rng, src)
    mode = rng.choice(["out-dir", "in-place", "out-dir-inside", "one-file"])
    if IS_ROOT:  # root reads mode-0 folders: make them unreadable the way os.walk sees them
        real_scandir = os.scandir

        def scandir(path="."):
            if Path(path).name.startswith("secret"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_scandir(path)

        monkeypatch.setattr(os, "scandir", scandir)
    before = state(tmp_path)
    if mode == "out-dir":
        status, err, _ = run(src, out_dir=str(tmp_path / "out"))
    elif mode == "out-dir-inside":
        status, err, _ = run(src, out_dir=str(src / "out"))
    elif mode == "in-place":
        status, err, _ = run(src, in_place=True)
    else:
        target = tmp_path / "single.py"
        rng.choice([lambda: None, lambda: target.write_text("old\n"),
                    lambda: target.symlink_to(tmp_path / "elsewhere.py"),
                    lambda: os.mkfifo(target)])()  # fmt: skip
        before = state(tmp_path)
        first = next((src / k for k, v in kinds.items() if v in ("good", "plain")), None)
        if first is None:
            return
        if target.exists() and stat.S_ISFIFO(os.lstat(target).st_mode):
            status, err, _ = run(first, output=str(target))  # nobody reads the FIFO
            assert status == 1 and "nothing is reading" in err
        else:
            status, err, _ = run(first, output=str(target))
            assert status == 0, err
            written = target.resolve() if target.is_symlink() else target
            assert (
                written.read_bytes()
                == expand_source(first.read_text(), path=str(first)).code.encode()
            )
            if target.is_symlink():
                assert os.readlink(target) == str(tmp_path / "elsewhere.py")  # still a link
        assert not temp_files(tmp_path)
        return
    assert status in (0, 1, 2) and "Traceback" not in err, err
    after = state(tmp_path)
    assert not temp_files(tmp_path), err
    failing = {"bad", "unreadable-dir"} | ({"readonly"} if mode == "in-place" else set())
    if status != 0:
        assert after == before, err  # nothing changed
        assert failing & set(kinds.values()), (kinds, err)
        if "unreadable-dir" in kinds.values():
            assert "secret" in err
        return
    assert not failing & set(kinds.values()), (kinds, err)
    for rel, kind in kinds.items():
        if kind == "good":
            dst = {"in-place": src, "out-dir": tmp_path / "out", "out-dir-inside": src / "out"}[
                mode
            ] / rel
            assert dst.read_bytes() == expand_source(GOOD.format(n=int(Path(rel).stem[1:])),
                                                     path=str(src / rel)).code.encode()  # fmt: skip
        elif kind in ("link", "fifo"):
            key = str(Path("src") / rel)
            assert after[key][0] == before[key][0]  # never replaced, never followed in a walk
    if mode == "out-dir-inside":
        assert not (src / "out" / "out").exists()  # its own outputs are not inputs


# -- special files and symlinks as -o ---------------------------------------------------------
def test_dev_null_is_written_through_not_replaced(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(GOOD.format(n=1))
    status, err, _ = run(src, output="/dev/null")
    assert status == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_fifo_with_a_reader_gets_the_expansion(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(GOOD.format(n=1))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    for _ in range(100):  # wait until the reader has the FIFO open
        status, err, _ = run(src, output=str(fifo))
        if status == 0 or "nothing is reading" not in err:
            break
        time.sleep(0.05)
    reader.join(10)
    assert status == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got == [expand_source(GOOD.format(n=1), path=str(src)).code.encode()]


def test_a_symlink_output_is_written_through(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(GOOD.format(n=1))
    real = tmp_path / "real.py"
    real.write_text("old\n")
    link = tmp_path / "link.py"
    link.symlink_to(real)
    assert run(src, output=str(link))[0] == 0
    assert link.is_symlink() and real.read_text().startswith("# Generated by macrogen")


def test_a_read_only_file_is_not_rewritten_in_place(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(GOOD.format(n=1))
    src.chmod(0o444)
    status, err, _ = run(src, in_place=True)
    assert status == 1 and "read-only" in err and str(src) in err
    assert src.read_text() == GOOD.format(n=1) and not temp_files(tmp_path)


def test_an_unreadable_subdirectory_is_an_error_naming_it(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    (src / "m.py").write_text(GOOD.format(n=1))
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    status, err, _ = run(src, out_dir=str(tmp_path / "out"))
    assert status == 1 and str(src / "locked") in err and "Permission denied" in err
    assert not (tmp_path / "out").exists()


def test_an_explicit_tuning_file_must_exist(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(GOOD.format(n=1))
    status, err, _ = run(src, tuning=str(tmp_path / "missing.json"))
    assert status == 2 and "missing.json: no such file" in err


# -- a write that fails midway ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["out-dir", "in-place"])
def test_a_write_failing_on_the_fourth_file_writes_nothing(tmp_path, monkeypatch, where):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"m{i}.py").write_text(GOOD.format(n=i))
    out = tmp_path / "out"
    out.mkdir()
    (out / "m0.py").write_text("old\n")
    before = state(tmp_path)
    real_stage, calls = files.stage, []

    def stage(path, data):
        calls.append(path)
        if len(calls) == 4:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stage(path, data)

    monkeypatch.setattr(files, "stage", stage)
    options = {"out_dir": str(out)} if where == "out-dir" else {"in_place": True}
    status, err, _ = run(src, **options)
    assert status == 1 and "Permission denied" in err and "m3.py" in err
    assert state(tmp_path) == before  # files 1-3 neither written nor rewritten
    assert not temp_files(tmp_path)


# -- SIGKILL mid-run ---------------------------------------------------------------------------
def test_sigkill_mid_run_never_truncates_and_the_next_run_cleans_up(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    originals = {}
    for i in range(60):
        text = GOOD.format(n=i)
        (src / f"m{i}.py").write_text(text)
        originals[f"m{i}.py"] = text.encode()
    expanded = {
        k: expand_source(v.decode(), path=str(src / k)).code.encode() for k, v in originals.items()
    }
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = random.Random(0)
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "macrogen", "expand", "--in-place", str(src)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(1.0, 4.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for name, data in originals.items():
            now = (src / name).read_bytes()
            assert now in (data, expanded[name]), (
                f"{name} is neither old nor new after kill {attempt}"
            )
        # A temporary file left by the killed run (staged, not yet renamed): ours, recognizable.
        (src / f".m0.py.macrogen-{proc.pid}-stale.tmp").write_bytes(b"half")
    done = subprocess.run(
        [sys.executable, "-m", "macrogen", "expand", "--in-place", str(src)],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert not temp_files(src), "the next run removes the temporary files of dead runs"
    for name in originals:
        assert (src / name).read_bytes() in (expanded[name],)


def test_a_live_runs_temporary_file_is_left_alone(tmp_path):
    live = tmp_path / f".m.py.macrogen-{os.getpid()}-abc.tmp"
    dead = tmp_path / ".m.py.macrogen-999999999-abc.tmp"
    other = tmp_path / ".m.py.something.tmp"
    for p in (live, dead, other):
        p.write_text("x")
    assert files.clean_stale(tmp_path) == 1
    assert live.exists() and other.exists() and not dead.exists()
