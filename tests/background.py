"""Long single-process checks started when the session starts, on the core the test
process leaves idle (CI has two; most tests are one process that waits on another, and
the interpreter runs are one core each for a minute or more).

``tests/conftest.py`` starts each run whose tests were collected; the test's fixture then
reads its output (``result``), waiting for it if it is still running. A run no test was
collected for is never started; a fixture whose run was not started runs it then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tests.helpers import REPO


@dataclass(frozen=True)
class Run:
    key: str  # the test file whose fixture reads it
    args: tuple[str, ...]  # after ``python``; "{dir}" is a fresh temporary folder
    env: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()  # variables taken out of the environment


RUNS = {
    "tile_cases": Run("test_tile_parity.py", ("-m", "tests.macros.tile_interpret", "{dir}", "cases"),
                      (("TRITON_INTERPRET", "1"),)),
    "tile_attention": Run("test_tile_parity.py",
                          ("-m", "tests.macros.tile_interpret", "{dir}", "attention"),
                          (("TRITON_INTERPRET", "1"),)),
    # the torch paths against the loops (seconds of pure Python per attention case)
    "tile_torch": Run("test_tile_parity.py", ("-m", "tests.macros.tile_torch_paths", "{dir}"),
                      drop=("TRITON_INTERPRET",)),
    # bench/tile.py --traffic sets TRITON_INTERPRET itself, before triton is imported
    "tile_traffic": Run("test_tile_traffic.py", ("bench/tile.py", "--traffic", "--json"),
                        drop=("TRITON_INTERPRET",)),
}  # fmt: skip

_started: dict[str, tuple[subprocess.Popen[str], str]] = {}


def start(key: str) -> None:
    """Start run ``key`` now, in the background (once)."""
    if key in _started:
        return
    run = RUNS[key]
    folder = tempfile.mkdtemp(prefix=f"mg-{key}-")
    env = {k: v for k, v in os.environ.items() if k not in run.drop}
    env.update(dict(run.env), PYTHONPATH=str(REPO))
    args = [a.replace("{dir}", folder) for a in run.args]
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _started[key] = (proc, folder)


def start_for(files: set[str]) -> None:
    """Start every run one of whose test files was collected."""
    for key, run in RUNS.items():
        if run.key in files:
            start(key)


def reader_files() -> set[str]:
    """The test files that read a run's output."""
    return {run.key for run in RUNS.values()}


def result(key: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``key``'s exit status and output (started now if it was not)."""
    start(key)
    proc, _ = _started[key]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return subprocess.CompletedProcess(
            proc.args, -9, out, f"timed out after {timeout} s\n{err}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop_all() -> None:
    """End what is still running (a session stopped early) and remove the folders."""
    for proc, folder in _started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(folder, ignore_errors=True)
    _started.clear()
