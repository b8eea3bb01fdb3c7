"""Run probe cases in processes forked from one that imported torch and macrogen once.

A case is a generator: it yields what it wants run (``Run``: one process, or several ranks
sharing a TCP store, started and awaited; ``Start``/``Join`` to act while they run;
``Until`` to wait for a condition) and returns its ``Verdict``. The scheduler keeps up to
``jobs`` cases in flight in this one thread (no fork from a threaded parent), kills a run's
process groups when its time is up (a hang) and never runs torch itself after start-up, so
every child starts from the same untouched interpreter.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Variables a launch sets: the parent's are dropped, each case sets its own.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One program: ``cli`` (macrogen's argv), ``script`` (a file run as __main__) or ``argv``
    (an executable), on ``ranks`` processes (torchrun's variables set when ranks > 0; 0: a
    plain serial process). ``env`` adds variables (None removes one); ``rank_env`` per rank."""

    cli: tuple[str, ...] | None = None
    script: str | None = None
    args: tuple[str, ...] = ()
    argv: tuple[str, ...] | None = None
    ranks: int = 0
    env: dict[str, str | None] = field(default_factory=dict)
    rank_env: dict[int, dict[str, str | None]] = field(default_factory=dict)
    timeout: float = 60.0
    stdin: bytes | None = None


@dataclass
class Result:
    codes: list[int | None]  # exit status by process (None: killed at the timeout)
    outs: list[str]
    errs: list[str]
    seconds: float
    pids: list[int] = field(default_factory=list)

    @property
    def hung(self) -> bool:
        return any(c is None for c in self.codes)

    @property
    def code(self) -> int | None:
        """The run's status as torchrun would give it: the first non-zero one, else 0."""
        if self.hung:
            return None
        return next((c for c in self.codes if c), 0)

    @property
    def out(self) -> str:
        return "".join(self.outs)

    @property
    def err(self) -> str:
        return "".join(self.errs)


@dataclass(frozen=True)
class Start:
    run: Run


@dataclass(frozen=True)
class Join:
    handle: Any


@dataclass(frozen=True)
class Until:
    ready: Callable[[], bool]
    timeout: float


@dataclass(frozen=True)
class Verdict:
    outcome: str  # ok, traceback, hang, silent wrong, failed
    line: str


CaseBody = Generator[Any, Any, Verdict]


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    body: Callable[[Path], CaseBody]
    ranks: bool = False  # starts ranks, or runs a model (a probe, a plan): not in the fast set


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(run: Run, folder: Path, rank: int, port: int, stem: str, base: dict[str, str]) -> None:
    """In the forked process: become the program, exit with its status."""
    os.setpgid(0, 0)  # its own group: a timeout kills what it started too
    os.chdir(folder)
    env = dict(base)
    if run.ranks:
        env.update(RANK=str(rank), WORLD_SIZE=str(run.ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(run.ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))  # fmt: skip
    for extra in (run.env, run.rank_env.get(rank, {})):
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    os.environ.clear()
    os.environ.update(env)
    stdin = os.open(os.devnull, os.O_RDONLY)
    if run.stdin is not None:
        (folder / f"{stem}.in").write_bytes(run.stdin)
        stdin = os.open(folder / f"{stem}.in", os.O_RDONLY)
    out = os.open(folder / f"{stem}.out{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(folder / f"{stem}.err{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    if run.argv is not None:
        os.execvpe(run.argv[0], list(run.argv), env)
    code = 1
    try:
        if run.cli is not None:
            from macrogen.cli import main

            sys.argv = ["macrogen", *run.cli]
            code = main(list(run.cli))
        else:
            assert run.script is not None
            sys.argv = [run.script, *run.args]
            sys.path.insert(0, str(folder))
            runpy.run_path(run.script, run_name="__main__")
            code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


class _Running:
    def __init__(self, run: Run, folder: Path, stem: str, base: dict[str, str]) -> None:
        self.run, self.folder, self.stem = run, folder, stem
        self.started = time.monotonic()
        port = free_port()
        self.pids = []
        for rank in range(max(run.ranks, 1)):
            pid = os.fork()
            if pid == 0:
                _child(run, folder, rank, port, stem, base)
            self.pids.append(pid)
        self.codes: dict[int, int | None] = {}

    def poll(self) -> bool:
        """True once every process ended (or was killed at the timeout)."""
        for pid in self.pids:
            if pid in self.codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[pid] = os.waitstatus_to_exitcode(status)
        if len(self.codes) < len(self.pids) and time.monotonic() - self.started > self.run.timeout:
            for pid in self.pids:
                if pid not in self.codes:
                    for sig in (signal.SIGKILL,):
                        try:
                            os.killpg(pid, sig)
                        except ProcessLookupError:
                            pass
                    os.waitpid(pid, 0)
                    self.codes[pid] = None
        return len(self.codes) == len(self.pids)

    def result(self) -> Result:
        def read(suffix: str, rank: int) -> str:
            path = self.folder / f"{self.stem}.{suffix}{rank}"
            return path.read_text(errors="replace") if path.exists() else ""

        n = len(self.pids)
        return Result(
            codes=[self.codes[p] for p in self.pids],
            outs=[read("out", r) for r in range(n)],
            errs=[read("err", r) for r in range(n)],
            seconds=time.monotonic() - self.started,
            pids=self.pids,
        )


class _Active:
    """A case in flight: its generator and what it waits for."""

    def __init__(self, case: Case, folder: Path) -> None:
        self.case, self.folder = case, folder
        self.started = time.monotonic()
        self.body = case.body(folder)
        self.waiting: Any = None
        self.until_deadline = 0.0
        self.runs = 0
        self.verdict: Verdict | None = None

    def send(self, value: Any, base: dict[str, str]) -> None:
        """Advance the case until it waits on something that is not ready."""
        while True:
            try:
                want = self.body.send(value)
            except StopIteration as stop:
                self.verdict = stop.value
                return
            except Exception as e:  # the probe's own bug: reported as such, never hidden
                self.verdict = Verdict("failed", f"probe error: {type(e).__name__}: {e}")
                return
            value = None
            if isinstance(want, (Run, Start)):
                run = want if isinstance(want, Run) else want.run
                self.runs += 1
                running = _Running(run, self.folder, f"run{self.runs}", base)
                if isinstance(want, Start):
                    value = running
                    continue
                self.waiting = ("join", running)
            elif isinstance(want, Join):
                self.waiting = ("join", want.handle)
            elif isinstance(want, Until):
                self.waiting = ("until", want)
                self.until_deadline = time.monotonic() + want.timeout
            else:
                raise TypeError(f"a case yielded {want!r}")
            return

    def step(self, base: dict[str, str]) -> None:
        kind, what = self.waiting
        if kind == "join" and what.poll():
            self.waiting = None
            self.send(what.result(), base)
        elif kind == "until":
            ready = what.ready()
            if ready or time.monotonic() > self.until_deadline:
                self.waiting = None
                self.send(ready, base)


def run_cases(
    cases: list[Case], root: Path, jobs: int, report: Callable[[Case, Verdict, float], None]
) -> list[tuple[Case, Verdict, float]]:
    """Every case, up to ``jobs`` at a time; ``report`` hears each as it ends."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith("MACROGEN_")
    }
    base.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    base["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), base.get("PYTHONPATH", "")) if p)
    pending, active, done = list(cases), [], []
    while pending or active:
        while pending and len(active) < jobs:
            case = pending.pop(0)
            folder = (
                root
                / f"{len(done) + len(active):03d}_{case.category}_{case.name}".replace("/", "_")[
                    :120
                ]
            )
            folder.mkdir(parents=True)
            entry = _Active(case, folder)
            entry.send(None, base)
            active.append(entry)
        for entry in list(active):
            if entry.verdict is None and entry.waiting is not None:
                entry.step(base)
            if entry.verdict is not None:
                active.remove(entry)
                seconds = time.monotonic() - entry.started
                done.append((entry.case, entry.verdict, seconds))
                report(entry.case, entry.verdict, seconds)
        time.sleep(0.02)
    return done
