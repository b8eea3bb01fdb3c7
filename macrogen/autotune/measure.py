"""How a candidate is timed: expanded into a temporary file, run by worker processes.

Each candidate's values are baked into its own expansion of the source
(``expand_source(..., tuning=values)``), written to a temporary directory. One
launch of ``macrogen.autotune.worker`` then times a list of candidates -- alone
for world size 1, under ``torchrun --standalone`` for more ranks -- so the
start-up (importing torch, the rendezvous) is paid once, not per candidate.
The worker times candidates in groups (``Timing.group``), interleaved over
``Timing.rounds`` rounds so that changing load from other processes hits
every candidate of a group alike. Results stream back one JSON line per
candidate and are handed to the caller as they arrive (the caller persists
them at once), so a killed run loses at most the group in flight.

The worker reports each phase it starts (a candidate's set-up with its
warm-up, or its turn in a round); a phase gets ``timeout`` seconds (the launch itself ``STARTUP_S``
more). If one overruns, or the worker dies under it, that candidate is
recorded as failed and the candidates not yet reported get a fresh launch.
Near the budget's deadline the worker stops between rounds and reports what
it timed; at the deadline the parent ends it, and what is in flight is lost.

A search that ranks what is left by what it has measured (layouts: the fitted
cost model) passes ``reorder``: after each result the parent writes the
pending candidates' new order to a file, and the worker, between groups,
waits briefly for the order that follows its last result and takes its first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macrogen.autotune.database import canonical
from macrogen.expand import ExpansionError, expand_source
from macrogen.files import write_atomic

POLL_S = 0.05
STARTUP_S = 120.0  # a launch's own allowance (imports, rendezvous) before its first candidate


@dataclass(frozen=True)
class Timing:
    """How long to look at each candidate."""

    warmup: int = 2  # untimed steps first: caches, allocator, Triton compiles, bucket set-up
    steps: int = 3  # timed steps per candidate and round, when several ranks run in lock step
    rounds: int = 4  # interleaved rounds: each times every candidate of its group in turn
    min_time: float = 0.2  # seconds of timing per candidate for torch.utils.benchmark / do_bench
    group: int = 8  # candidates alive and timed together (interleaved); 1: one after another
    timeout: float = 180.0  # seconds per candidate phase without progress (set-up, a round)


@dataclass(frozen=True)
class Measurement:
    values: dict[str, Any]
    time_s: float | None = None  # median seconds per step; None when it failed
    samples: int = 0
    signature: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    peak_bytes: tuple[int, ...] = ()  # per rank, for layouts: memory above the pre-build baseline


@dataclass(frozen=True)
class Program:
    """What every candidate shares: the source, the entry and where it runs."""

    source_path: Path
    source: str
    entry: str  # "module:factory"
    entry_in_source: bool  # the factory is defined in the tuned file: take it from the expansion
    world_size: int
    target: str  # "cpu" or "cuda"
    timing: Timing
    layout: bool = False  # candidates are parallel layouts: a mesh each, peak memory measured

    def mode(self) -> str:
        if self.world_size > 1:
            return "ranks"
        return "do_bench" if self.target == "cuda" else "benchmark"


# Returns False to stop measuring (early stopping); the candidate in flight is dropped.
OnResult = Callable[[Measurement], bool]
# The pending candidates (values), in the order to measure them next.
Reorder = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def measure(
    program: Program,
    candidates: list[dict[str, Any]],
    on_result: OnResult,
    *,
    deadline: float | None = None,
    reorder: Reorder | None = None,
) -> str:
    """Measure candidates in order (``reorder``'s, as it changes), calling ``on_result`` with
    each; why it stopped."""
    with tempfile.TemporaryDirectory(prefix="macrogen-autotune-") as tmp:
        work = Path(tmp)
        pending: list[tuple[str, dict[str, Any], Path]] = []
        for i, values in enumerate(candidates):
            try:
                code = expand_source(
                    program.source,
                    path=program.source_path.name,
                    target=program.target,
                    tuning=values,
                ).code
            except ExpansionError as e:
                message = "; ".join(d.message for d in e.diagnostics)
                if not on_result(Measurement(values, error=f"expansion failed: {message}")):
                    return "stopped"
                continue
            file = work / f"c{i}" / program.source_path.name
            file.parent.mkdir()
            file.write_text(code, encoding="utf-8")
            pending.append((f"c{i}", values, file))
        launches = 0
        while pending:
            launches += 1
            if reorder is not None:
                pending[:] = _reordered(pending, reorder)
            outcome = _launch(
                program, pending, on_result, deadline, work / f"launch{launches}", reorder
            )
            if outcome != "relaunch":
                return outcome
        return "complete"


def _launch(
    program: Program,
    pending: list[tuple[str, dict[str, Any], Path]],
    on_result: OnResult,
    deadline: float | None,
    work: Path,
    reorder: Reorder | None = None,
) -> str:
    """One worker launch over ``pending`` (consumed in place)."""
    work.mkdir()
    results = work / "results.jsonl"
    results.touch()
    order = work / "order.json" if reorder is not None else None
    log = work / "worker.log"
    job = {
        "candidates": [
            {"id": cid, "file": str(file), "module": f"{file.stem}_mg_{cid}"}
            for cid, _, file in pending
        ],
        "entry": program.entry,
        "entry_in_source": program.entry_in_source,
        "layout": program.layout,
        "target": program.target,  # the memory window: CUDA's allocator, or torch's CPU one
        "parent_pid": os.getpid(),
        # the worker's own deadline (wall clock, a second early): it stops between rounds
        "deadline": None if deadline is None else time.time() + deadline - time.monotonic() - 1.0,
        "results": str(results),
        "order": None if order is None else str(order),  # {"after": results, "ids": [...]}
        "source": str(program.source_path.resolve()),
        "sys_path": [str(program.source_path.parent.resolve()), os.getcwd()],
        "timing": {
            "min_time": program.timing.min_time,
            "mode": program.mode(),
            "steps": program.timing.steps,
            "rounds": program.timing.rounds,
            "group": program.timing.group,
            "warmup": program.timing.warmup,
        },
    }
    (work / "job.json").write_text(json.dumps(job, indent=2))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # time the real paths: CUDA kernels or the torch CPU path
    env.setdefault("KINETO_LOG_LEVEL", "5")  # the memory window's profiler: no start/stop lines
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _command(program, work / "job.json"),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # so the whole group (torchrun and its ranks) can be ended
        )
    try:
        return _follow(proc, program, pending, on_result, deadline, results, log, reorder, order)
    finally:
        _end(proc, work)


def _follow(
    proc: subprocess.Popen[bytes],
    program: Program,
    pending: list[tuple[str, dict[str, Any], Path]],
    on_result: OnResult,
    deadline: float | None,
    results: Path,
    log: Path,
    reorder: Reorder | None = None,
    order: Path | None = None,
) -> str:
    by_id = {cid: values for cid, values, _ in pending}
    offset, last_progress, current = 0, time.monotonic(), None
    stopping = out_of_budget = False
    reported = 0  # results of this launch handed on (the worker counts the same)
    while True:
        exited = proc.poll() is not None
        with results.open("r", encoding="utf-8") as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            result = json.loads(line)
            last_progress = time.monotonic()
            if "start" in result:  # the worker is on this candidate now
                current = result["start"]
                continue
            if "budget" in result:  # the worker stopped itself at the deadline
                out_of_budget = True
                continue
            pending[:] = [p for p in pending if p[0] != result["id"]]
            # after a stop, what already arrived is still recorded
            keep_going = on_result(_measurement(by_id[result["id"]], result))
            stopping = stopping or not keep_going
            reported += 1
            if reorder is not None and order is not None and not stopping:
                pending[:] = _reordered(pending, reorder)
                _write_order(order, reported, [cid for cid, _, _ in pending])
        if stopping:
            return "stopped"
        if out_of_budget:
            return "budget"
        if not pending:
            return "complete"
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return "budget"
        limit = program.timing.timeout + (0 if current is not None else STARTUP_S)
        if exited or now - last_progress > limit:
            culprit = next((p for p in pending if p[0] == current), pending[0])
            pending.remove(culprit)
            if exited:
                error = f"the worker exited with status {proc.returncode}: {_tail(log)}"
            else:
                error = f"timed out after {program.timing.timeout:g} s"
            if not on_result(Measurement(culprit[1], error=error)):
                return "stopped"
            return "relaunch" if pending else "complete"
        time.sleep(POLL_S)


def _reordered(
    pending: list[tuple[str, dict[str, Any], Path]], reorder: Reorder
) -> list[tuple[str, dict[str, Any], Path]]:
    """``pending`` in ``reorder``'s order of their values (any it leaves out, last)."""
    position = {canonical(v): i for i, v in enumerate(reorder([v for _, v, _ in pending]))}
    return sorted(pending, key=lambda p: position.get(canonical(p[1]), len(position)))


def _write_order(order: Path, after: int, ids: list[str]) -> None:
    """The worker's next candidates, once it has reported ``after`` results (written whole)."""
    write_atomic(order, json.dumps({"after": after, "ids": ids}).encode())


def _measurement(values: Mapping[str, Any], result: Mapping[str, Any]) -> Measurement:
    if "error" in result:
        return Measurement(dict(values), error=result["error"])
    return Measurement(
        dict(values),
        time_s=float(result["time_s"]),
        samples=int(result["samples"]),
        signature=dict(result.get("signature") or {}),
        peak_bytes=tuple(int(x) for x in result.get("peak_bytes", ())),
    )


def _command(program: Program, job: Path) -> list[str]:
    worker = ["-m", "macrogen.autotune.worker", str(job)]
    if program.world_size == 1:
        return [sys.executable, *worker]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={program.world_size}",
        *worker,
    ]


def _end(proc: subprocess.Popen[bytes], work: Path) -> None:
    """Stop a launch still running: the launcher's process group, then each rank. torchrun
    starts every rank in a session of its own, so a rank outlives a killed torchrun and
    would go on measuring beside the next launch; each rank wrote its pid at its start."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    from macrogen.autotune.worker import PID_SUFFIX

    for pid_file in work.glob(f"*{PID_SUFFIX}"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if _runs_job(pid, work):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _runs_job(pid: int, work: Path) -> bool:
    """Whether ``pid`` is still a worker of this launch (not a process that reused the pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        # no such process, or no /proc (macOS): a pid written seconds ago is still the rank's
        return not Path("/proc/self").exists()
    except OSError:
        return False
    return str(work).encode() in cmdline


def _tail(log: Path, lines: int = 6) -> str:
    text = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    useful = [line for line in text if line.strip() and not line.startswith("*****")]
    return " | ".join(useful[-lines:]) or "no output"
