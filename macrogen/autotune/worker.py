"""The process that times candidates: ``python -m macrogen.autotune.worker JOB.json``.

``measure.py`` launches it alone (world size 1) or under torchrun, one per rank.
For each candidate of the job, in order, every rank imports that candidate's
expanded file, builds a step with the entry factory, warms up and times it;
rank 0 appends one JSON line per candidate to the results file as soon as it
is known. With an ``order`` file (a search that re-ranks as it learns), the
candidates left are taken in the order the parent wrote after the last result.
A candidate that fails (import, factory, step) is reported with its error and
the next one runs: the ranks agree on failures after each phase, so no rank
waits alone in a collective.

The entry contract (see docs/autotune.md): ``factory(module)`` gets the
expanded module and returns ``step`` -- a callable that runs one training step
-- or ``(step, signature)`` where ``signature`` is a JSON-able dict of the
dtypes and shapes it runs (recorded in the tuning key). A factory defined in
the tuned file itself may take no argument.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime import environment

PID_SUFFIX = ".pid"  # each rank's pid, in its launch's folder: measure._end stops it by that


class CandidateError(Exception):
    """A failure attributed to one candidate, with the phase it happened in."""


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    # the launch ends a rank that outlives its torchrun by this pid (measure._end)
    rank_env = environment.whole("RANK", 0, low=0)
    (Path(job_path).parent / f"rank{rank_env}{PID_SUFFIX}").write_text(str(os.getpid()))
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    source = Path(job["source"])
    _SOURCE.update(
        work=Path(job["candidates"][0]["file"]).parent.parent,
        name=source.name,
        lines=source.read_text(encoding="utf-8").splitlines(),
    )
    distributed = environment.whole("WORLD_SIZE", 1, low=1) > 1
    if distributed:
        from macrogen.runtime.groups import ensure_initialized

        ensure_initialized()
    rank = dist.get_rank() if distributed else 0
    entry_factory = _entry_factory(job)  # a factory, an error text, or None (in the module)
    results = Path(job["results"])
    size = job["timing"]["group"]
    remaining, reported = list(job["candidates"]), 0
    while remaining:
        if not _parent_alive(job["parent_pid"]):
            # autotune itself was killed: nobody reads what we would write, or cleans up
            if rank == 0:
                shutil.rmtree(_SOURCE["work"], ignore_errors=True)
            return 1
        if reported and job.get("order"):
            remaining = _in_order(remaining, job["order"], reported, distributed, rank)
        group, remaining = remaining[:size], remaining[size:]
        measured, ran_out = _measure_group(group, job, entry_factory, distributed, rank, results)
        for result in measured:
            if rank == 0:
                _append(results, result)
        reported += len(measured)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if ran_out:
            if rank == 0:
                _append(results, {"budget": True})
            break
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


ORDER_WAIT_S = 5.0  # how long the worker waits for the parent's order after a result


def _in_order(
    remaining: list[dict[str, Any]], order: str, reported: int, distributed: bool, rank: int
) -> list[dict[str, Any]]:
    """``remaining`` in the parent's order, once it has seen our ``reported`` results (rank
    0 reads it and tells the others); the order as it was if none comes in time."""
    ids: list[Any] = [None]
    if rank == 0:
        waited_until = time.monotonic() + ORDER_WAIT_S
        while True:
            try:
                found = json.loads(Path(order).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                found = None
            if found is not None and found.get("after", 0) >= reported:
                ids[0] = found["ids"]
                break
            if time.monotonic() > waited_until:
                break
            time.sleep(0.01)
    if distributed:
        dist.broadcast_object_list(ids, src=0)
    if ids[0] is None:
        return remaining
    position = {cid: i for i, cid in enumerate(ids[0])}
    return sorted(remaining, key=lambda c: position.get(c["id"], len(position)))


def _append(results: Path, line: dict[str, Any]) -> None:
    with results.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        f.flush()


def _out_of_time(job: dict[str, Any], distributed: bool, need: float = 0.0) -> bool:
    """Whether ``need`` more seconds would pass the budget's deadline; rank 0's clock decides."""
    if job["deadline"] is None:
        return False
    decision = [time.time() + need > job["deadline"]]
    if distributed:
        dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _measure_group(
    group: list[dict[str, Any]],
    job: dict[str, Any],
    entry_factory: Any,
    distributed: bool,
    rank: int,
    results: Path,
) -> tuple[list[dict[str, Any]], bool]:
    """Time a group of candidates interleaved: round r times each candidate's steps in turn.

    Load from other processes comes and goes; interleaving exposes every
    candidate of the group to the same conditions, so their ratios hold even
    when their absolute times drift. Near the budget's deadline it stops
    early: candidates timed in every round so far are reported (all with the
    same rounds), the others not at all; the flag says it ran out.
    """
    timing = job["timing"]
    mode = "ranks" if distributed else timing["mode"]

    def started(cid: str) -> None:  # the parent's per-candidate clock restarts at each line
        if rank == 0:
            _append(results, {"start": cid})

    out: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    # layouts (one candidate per group): each builds its own mesh; its tensors' peak from the
    # build through the warm-up steps (at least two: the optimizer's state, then a steady step)
    layout = bool(job.get("layout"))
    peaks: dict[str, int] = {}
    signatures: dict[str, dict[str, Any]] = {}
    times: dict[str, list[float]] = {}
    ran_out = False
    for candidate in group:
        if _out_of_time(job, distributed):
            ran_out = True
            break
        cid = candidate["id"]
        started(cid)
        window: Any = contextlib.nullcontext()
        warmup = timing["warmup"]
        if layout:
            from macrogen.autotune import process_memory
            from macrogen.runtime import mesh

            mesh.reset()
            process_memory.warm_process(distributed)  # torch's one-time buffers come before
            window = process_memory.TensorPeak(cuda=job.get("target") == "cuda")
            warmup = max(2, warmup)
        try:
            with window:
                step, signatures[cid] = _agree(
                    distributed, "setup", functools.partial(_build, candidate, job, entry_factory)
                )
                _agree(
                    distributed, "warm-up", functools.partial(_repeat, step, warmup, distributed)
                )
            steps[cid], times[cid] = step, []
            if layout:
                peaks[cid] = window.peak
        except CandidateError as e:
            out[cid] = {"id": cid, "error": str(e)}
    last_round = 0.0
    for r in range(timing["rounds"]):
        if ran_out or _out_of_time(job, distributed, need=last_round):
            ran_out = True
            break
        round_started = time.monotonic()
        live = [c["id"] for c in group if c["id"] in steps]
        for cid in live[r % len(live) :] + live[: r % len(live)] if live else []:
            started(cid)
            try:
                chunk = _agree(
                    distributed, "timing", functools.partial(TIMERS[mode], steps[cid], timing)
                )
                times[cid].extend(chunk)
            except CandidateError as e:
                out[cid] = {"id": cid, "error": str(e)}
                del steps[cid]
        last_round = time.monotonic() - round_started
    for cid in list(steps):
        if not times[cid]:  # never timed: the deadline came first
            continue
        out[cid] = {
            "id": cid,
            "time_s": statistics.median(times[cid]),
            "samples": len(times[cid]),
            "signature": signatures[cid],
        }
        if layout:
            out[cid]["peak_bytes"] = _peaks(peaks[cid], distributed)
    steps.clear()
    return [out[c["id"]] for c in group if c["id"] in out], ran_out


def _peaks(mine: int, distributed: bool) -> list[int]:
    """Each rank's tensor peak, from its candidate's build through its warm-up."""
    if not distributed:
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [int(x) for x in every]


def _build(
    candidate: dict[str, Any], job: dict[str, Any], entry_factory: Any
) -> tuple[Callable[[], Any], dict[str, Any]]:
    try:
        module = _import_file(candidate["file"], candidate["module"])
    except BaseException as e:
        raise CandidateError(f"importing the expanded file failed: {_describe(e)}") from None
    if isinstance(entry_factory, str):
        raise CandidateError(entry_factory)
    factory = entry_factory
    if factory is None:  # the factory is defined in the tuned file itself
        name = job["entry"].split(":", 1)[1]
        factory = getattr(module, name, None)
        if not callable(factory):
            raise CandidateError(f"the tuned file defines no callable {name!r} (--entry)")
    torch.manual_seed(0)  # every candidate starts from the same model and data
    try:
        made = factory(module) if _takes_an_argument(factory) else factory()
    except BaseException as e:
        raise CandidateError(f"the entry factory raised {_describe(e)}") from None
    step, signature = _step_and_signature(made)
    return step, json.loads(json.dumps(signature, sort_keys=True, default=str))


def _step_and_signature(made: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
    """``step``, or a tuple holding it: its callable that is no nn.Module, and a dict signature."""
    parts = made if isinstance(made, tuple) else (made,)
    steps = [p for p in parts if callable(p) and not isinstance(p, torch.nn.Module)]
    signatures = [p for p in parts if isinstance(p, dict)]
    if len(steps) != 1 or len(signatures) > 1:
        raise CandidateError(
            "the entry factory must return step, (step, signature) or (model, step):"
            f" got {type(made).__name__} with {len(steps)} step callable(s)"
        )
    return steps[0], signatures[0] if signatures else {}


def _entry_factory(job: dict[str, Any]) -> Any:
    """The factory from the entry module; None when it lives in the tuned file."""
    module_name, name = job["entry"].split(":", 1)
    if job["entry_in_source"]:
        return None
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:
        return f"importing the entry module {module_name!r} failed: {_describe(e)}"
    factory = getattr(module, name, None)
    if not callable(factory):
        return f"the entry module {module_name!r} has no callable {name!r}"
    return factory


def _import_file(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


def _agree(distributed: bool, phase: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it fails on any, fail on all with that rank's error."""
    error, value = None, None
    try:
        value = fn()
    except CandidateError as e:
        error = str(e)
    except BaseException as e:
        error = f"{phase} raised {_describe(e)}"
    if distributed:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, error = failed[0]
            error = f"rank {rank}: {error}"
    if error is not None:
        raise CandidateError(error)
    return value


def _describe(e: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame, in the user's file."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {_user_location(last.filename, last.lineno, last.line)} in {last.name})"
    return text


# The tuned file: (its expanded copies' directory, its path, its lines); set by main().
_SOURCE: dict[str, Any] = {}


def _user_location(filename: str, lineno: int | None, text: str | None) -> str:
    """A line of an expanded copy, shown as the source line it came from when that is unambiguous."""
    name = Path(filename).name
    if not _SOURCE or Path(filename).parent.parent != _SOURCE["work"] or not text:
        return f"{name}:{lineno}"
    matches = [i for i, line in enumerate(_SOURCE["lines"], 1) if line.strip() == text.strip()]
    if len(matches) == 1:
        return f"{_SOURCE['name']}:{matches[0]}"
    return f"{name}:{lineno} of the expansion"


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- timers: each returns seconds per step ---------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _repeat(step: Callable[[], Any], n: int, distributed: bool) -> None:
    for _ in range(n):
        step()
        if distributed:
            dist.barrier()
    _sync()


def time_benchmark(step: Callable[[], Any], timing: dict[str, Any]) -> list[float]:
    """One process on CPU: torch.utils.benchmark picks the repetitions for this round's share."""
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="step()", globals={"step": step})
    per_round = timing["min_time"] / timing["rounds"]
    return list(timer.blocked_autorange(min_run_time=per_round).times)


def time_do_bench(step: Callable[[], Any], timing: dict[str, Any]) -> list[float]:
    """One process on CUDA: Triton's do_bench (flushes L2, times with CUDA events); this round's share."""
    from triton.testing import do_bench

    ms = max(1, int(timing["min_time"] * 1000 / timing["rounds"]))
    quantiles = do_bench(step, warmup=ms // 4 + 1, rep=ms, quantiles=[0.2, 0.5, 0.8])
    return [q / 1000 for q in quantiles]  # the median stays the median


def time_ranks(step: Callable[[], Any], timing: dict[str, Any]) -> list[float]:
    """Several ranks: this round's steps in lock step; a step lasts until the slowest rank ends it."""
    times = []
    for _ in range(timing["steps"]):
        dist.barrier()
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        dist.barrier()
        times.append(time.perf_counter() - start)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


TIMERS = {"benchmark": time_benchmark, "do_bench": time_do_bench, "ranks": time_ranks}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
