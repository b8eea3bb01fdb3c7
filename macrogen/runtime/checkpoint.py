"""Resumable training loops on torch.distributed.checkpoint (DCP) and torchrun restarts.

    for step in resumable(range(steps), model=model, optimizer=opt, dir="ckpt", every=50):
        ...                                   # one training step

When the loop starts it loads the latest *complete* checkpoint under ``dir`` (model,
optimizer, step, per-rank torch RNG states, data position) and skips the steps that
checkpoint already covers; every ``every`` steps it saves with ``dcp.async_save``,
which blocks only while the state is copied to host memory, and it keeps the last
``keep`` complete checkpoints. Under ``torchrun --max-restarts N`` a killed rank
makes torchrun restart every rank, and the restarted loop carries on exactly where
the latest complete checkpoint left it.

Layout of ``dir`` (DCP's own format, one folder per checkpoint)::

    ckpt/step_00000050/.metadata, __0_0.distcp, __1_0.distcp, ...   written by DCP
    ckpt/step_00000050/macrogen_complete.json                      written last, by rank 0

The marker is what makes a checkpoint count. Rank 0 writes it (temporary file,
fsync, rename) once its save future has finished. DCP's save ends with a gather of
every rank's write results on rank 0 before rank 0 writes ``.metadata``, so rank 0's
future finishing means every rank's files are written (and fsynced: FileSystemWriter's
default). A crash at any point of a save leaves a folder without a marker, which the
next start skips with a warning. The marker lists every file's size, so a truncated
file is caught before loading; a checkpoint DCP fails to read is skipped too.

Serially (no process group, no torchrun) the same DCP format is written by the one
process, so checkpoints move between 1, 2 and 4 ranks in both directions (DCP
reshards on load). Checkpoint traffic runs on a process group of its own (gloo), so
the background save thread never interleaves collectives with the training loop's.

A model with parameter-server tables (``param_server``) is checkpointed by its
workers alone, on the workers' gloo group the job made at start-up (the server
ranks have left the default group's collectives): worker 0 pulls the tables and
their optimizer state over RPC into the checkpoint (``servers.*``), and a load
sends them back to the servers before the first step.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from macrogen import files
from macrogen.runtime import checkpoint_state, groups, param_server
from macrogen.runtime.checkpoint_files import (
    MAX_MARKER_BYTES,
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    SafeReader,
    Unusable,
    folder_error,
    free_bytes,
    one_line,
    read_metadata,
    read_regular,
    root_error,
    short_write,
    storage_error,
)

T = TypeVar("T")

# Serially DCP says, on every save and load, that it assumes one process: it does.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

MARKER = "macrogen_complete.json"
PREFIX = "step_"
FORMAT = 1  # version of the marker's contents
SET_ASIDE = ".unreadable"  # suffix of an unusable checkpoint moved out of a save's way
FRESH_ENV = "MACROGEN_FRESH"  # 1: start over at step 0, as fresh=True
ON_SAVE_ERROR = ("error", "warn")
LOW_SPACE = 1 << 20  # bytes free under which a short write is put down to a full disk
MAX_RNG_BYTES = 1 << 20  # torch's CPU RNG state is 5056 bytes, CUDA's 16 per device

# What examine() says of a step folder
COMPLETE = "complete"  # marker and files as the save wrote them
PARTIAL = "partial"  # no marker: a save that did not finish (deleted when in the way)
UNUSABLE = "unusable"  # a marker, but it can't be used: kept, never deleted


class CheckpointError(RuntimeError):
    """A checkpoint directory that can't be used: unwritable, or from another model."""


class _Unreadable(Exception):
    """A checkpoint that looked complete but can't be loaded: the previous one is tried."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Path  # one folder per checkpoint below it: step_00000050/
    every: int  # save after every `every` steps
    keep: int  # complete checkpoints kept; older ones are deleted
    fresh: bool = False  # start at step 0 whatever is there (unusable checkpoints are kept)
    on_save_error: str = "error"  # "warn": a save the disk refused is dropped, training goes on


def resumable(
    iterable: Iterable[T],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    dir: str | os.PathLike[str],
    every: int,
    keep: int = 2,
    fresh: bool = False,
    on_save_error: str = "error",
) -> Iterator[T]:
    """The items of ``iterable``, resumed from and checkpointed to ``dir``.

    Runs the start-up at the call (a read-only ``dir`` or a checkpoint of another
    model fails here, not at the first save), then returns the loop's iterator.
    Every rank of the job must call it at the same point.

    ``fresh=True`` (or ``MACROGEN_FRESH=1``) starts at step 0 whatever ``dir`` holds;
    without it, checkpoints that exist but can't be used are an error. With
    ``on_save_error="warn"`` a save the disk refuses (full, quota) is a warning and
    training goes on from the last complete checkpoint; by default it is an error.
    """
    config = _config(dir, every, keep, fresh, on_save_error)
    loop = _Checkpointer(config, model, _optimizers(optimizer))
    start = loop.start(_length(iterable))
    items = _skip(iterable, start)
    loop.restore_rng()  # after the skip: the draws of skipped items happened before the save
    return loop.run(items, start)


def init_process_group(backend: str | None = None) -> None:
    """The default group from torchrun's environment, safe across torchrun restarts.

    ``groups.ensure_initialized`` does the same (each attempt's keys under a prefix
    of their own in torchrun's store); this one lets the program name the backend.
    """
    where = groups.placement()
    groups.init(where if backend is None else dataclasses.replace(where, backend=backend))


def _config(
    dir: Any, every: Any, keep: Any, fresh: Any = False, on_save_error: Any = "error"
) -> CheckpointConfig:
    for name, value in (("every", every), ("keep", keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"resumable(): {name} must be a whole number >= 1, not {value!r}")
    if not isinstance(dir, (str, os.PathLike)) or not str(dir):
        raise ValueError(f"resumable(): dir must be a path, not {dir!r}")
    if not isinstance(fresh, bool):
        raise ValueError(f"resumable(): fresh must be True or False, not {fresh!r}")
    if on_save_error not in ON_SAVE_ERROR:
        raise ValueError(
            f"resumable(): on_save_error must be 'error' or 'warn', not {on_save_error!r}"
        )
    env = os.environ.get(FRESH_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{FRESH_ENV} must be 1 or 0, not {env!r}")
    return CheckpointConfig(Path(dir), every, keep, fresh or env == "1", on_save_error)


def _length(iterable: Iterable[Any]) -> int | None:
    """How many items the loop has, where the iterable says (a range, a list); else None."""
    try:
        return len(iterable)  # type: ignore[arg-type]
    except Exception:  # no __len__, or one that fails: not known
        return None


def _optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def _skip(iterable: Iterable[T], n: int) -> Iterator[T]:
    """The iterable's items from the n-th on (a range is sliced, anything else drawn and dropped)."""
    if isinstance(iterable, range):
        return iter(cast(Iterable[T], iterable[n:]))
    items = iter(iterable)
    next(itertools.islice(items, n, n), None)
    return items


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    """The step of a folder named step_<ASCII digits> (not '²', which isdigit() takes)."""
    tail = path.name[len(PREFIX) :]
    ok = path.name.startswith(PREFIX) and 0 < len(tail) <= 18 and tail.isascii() and tail.isdigit()
    return int(tail) if ok else None


class _Checkpointer:
    """One rank's side of the loop: start-up, asynchronous saves, markers, pruning."""

    def __init__(
        self,
        config: CheckpointConfig,
        model: torch.nn.Module,
        optimizers: tuple[torch.optim.Optimizer, ...],
    ):
        self.config = config
        self.model = model
        self.optimizers = optimizers
        checkpoint_state.check_supported(model)
        distributed = groups.ensure_initialized()
        self.servers = param_server.job_of(model)
        if self.servers is not None:
            # Server tables: the server ranks have left the default group's collectives, so
            # the workers checkpoint among themselves and pull the tables over RPC.
            self.group = self.servers.checkpoints
        else:
            # A group of its own: DCP's background thread runs collectives while the
            # training loop runs its own on the default group.
            self.group = dist.new_group(backend="gloo") if distributed else None
        self.rank = dist.get_rank(self.group) if distributed else 0
        self.world_size = dist.get_world_size(self.group) if distributed else 1
        self.pending: tuple[int, Future[Any]] | None = None  # (step, future) of the save in flight
        self.rng: dict[str, torch.Tensor] = {}  # this rank's RNG states from the loaded checkpoint

    # ---- start-up ---------------------------------------------------------------

    def start(self, length: int | None = None) -> int:
        """Check ``dir``, load the latest usable checkpoint; the step to start at.

        ``length``: the loop's number of items, where known (a checkpoint past it is refused).
        """
        root = self.config.dir
        self._agree(_writable_error(root, self.rank) or root_error(root))
        survey: list[tuple[int, str, str]] = self._broadcast(
            _survey(root) if self.rank == 0 else None
        )
        unusable = {step: why for step, state, why in survey if state == UNUSABLE}
        start = 0
        if not self.config.fresh:
            for step, state, why in survey:  # newest first
                path = step_dir(root, step)
                if state != COMPLETE:
                    self._warn(f"skipping checkpoint {path}: {why}")
                    continue
                try:
                    start = self._load(path, step, length)
                except _Unreadable as e:  # alike on every rank: DCP gathers failures
                    unusable[step] = str(e)
                    self._warn(f"skipping checkpoint {path}: {e}")
                    continue
                break
            else:
                if unusable:
                    raise CheckpointError(_none_usable(root, unusable))
        if self.rank == 0:
            # Folders past the starting point would be written again by this run: a partial
            # save (or, with fresh, a checkpoint) is deleted, an unusable one set aside.
            for step, _, _ in survey:
                if step <= start:
                    continue
                if step in unusable:
                    _set_aside(step_dir(root, step))
                else:
                    _remove(step_dir(root, step))
        self._barrier()
        return start

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            _warn(message)

    def _load(self, path: Path, step: int, length: int | None) -> int:
        """Load the checkpoint at ``path`` (of step ``step``) into the model and optimizers;
        its step."""
        try:
            metadata = read_metadata(path)
        except (Unusable, OSError) as e:
            raise _Unreadable(f"its .metadata can't be read: {one_line(e)}") from None
        entry = metadata.state_dict_metadata.get("loop.step")
        if not isinstance(entry, BytesStorageMetadata):
            raise _Unreadable("it has no loop.step")
        if length is not None and step > length:
            raise CheckpointError(
                f"checkpoint {path} is at step {step}, past the end of this loop ({length}"
                f" items): it is from a longer run (move it away, or pass fresh=True)"
            )
        state = self._state(0, metadata=metadata)
        _check_same_model(path, state, metadata)
        globalized = state.pop("globalized")
        try:
            dcp.load(
                state,
                storage_reader=SafeReader(path, metadata),
                planner=SafeLoadPlanner(),
                process_group=self.group,
                no_dist=self.group is None,
            )
        except (Exception, CheckpointException) as e:  # the files are data from disk: any failure
            raise _Unreadable(f"DCP can't read it: {one_line(e)}") from None
        saved = state["loop"]["step"]
        if isinstance(saved, bool) or not isinstance(saved, int) or saved != step:
            raise _Unreadable(f"its loop.step is {saved!r}, not {step}")
        checkpoint_state.set_state(
            self.model, self.optimizers, state["model"], state.get("optim", {}), globalized
        )
        if self.servers is not None:  # before the first fetch: the servers resume too
            param_server.load_state_dict(self.model, state["servers"])
        self.rng = state["rng"].get(f"rank{self.rank}", {})
        return step

    def restore_rng(self) -> None:
        if "cpu" in self.rng:
            torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(self.rng["cuda"]))

    # ---- the loop -----------------------------------------------------------------

    def run(self, items: Iterator[T], start: int) -> Iterator[T]:
        done = start
        try:
            for item in items:
                self._poll()
                yield item
                done += 1
                if done % self.config.every == 0:
                    self._save(done)
        finally:
            self._wait()

    def _save(self, step: int) -> None:
        self._wait()  # one save in flight at a time
        path = step_dir(self.config.dir, step)
        # async_save copies the state to host memory before it returns (the blocking
        # part); the files are written by a background thread.
        try:
            future = dcp.async_save(
                self._state(step),
                checkpoint_id=path,
                process_group=self.group,
                no_dist=self.group is None,
            )
        except (Exception, CheckpointException) as e:
            self._save_failed(path, e)
            return
        if not isinstance(future, Future):  # an AsyncSaveResponse (async staging): the upload
            future = future.upload_completion
        self.pending = (step, future)

    def _poll(self) -> None:
        if self.pending is not None and self.pending[1].done():
            self._wait()

    def _wait(self) -> None:
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        path = step_dir(self.config.dir, step)
        try:
            future.result()  # a failed save raises here, on every rank
            if self.rank == 0:
                write_marker(path, step, self.world_size)
        except (Exception, CheckpointException) as e:
            self._save_failed(path, e)
            return
        if self.rank == 0:
            prune(self.config.dir, self.config.keep)

    def _save_failed(self, path: Path, e: BaseException) -> None:
        """A save that failed: its partial folder removed; a disk's refusal named, and with
        on_save_error="warn" only warned about (the last complete checkpoint stays)."""
        cause = _save_cause(path, e)  # before the removal frees the space
        if self.rank == 0:
            _remove(path)
        if cause is None:  # not the disk: a bug, raised as it is
            raise e
        message = f"can't save checkpoint {path}: {cause}"
        if self.config.on_save_error == "warn":
            _warn(f"{message}; training goes on from the last complete one")
            return
        raise CheckpointError(message) from None

    # ---- state --------------------------------------------------------------------

    def _state(self, step: int, metadata: Metadata | None = None) -> dict[str, Any]:
        """What a checkpoint holds; for a load (``metadata``), RNG slots shaped as saved,
        and under ``"globalized"`` the tensors ``checkpoint_state.set_state`` makes local again."""
        load = metadata is not None
        model, optim, globalized = checkpoint_state.get_state(
            self.model, self.optimizers, load=load
        )
        rng: dict[str, torch.Tensor] = {}
        if metadata is None:
            rng["cpu"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        else:  # this rank's states if the saving job had this rank
            for kind, dims in (("cpu", 1), ("cuda", 2)):
                key = f"rng.rank{self.rank}.{kind}"
                entry = metadata.state_dict_metadata.get(key)
                if entry is None:
                    continue
                # an RNG state is a few kB of bytes: anything else is refused before allocating
                if not (
                    isinstance(entry, TensorStorageMetadata)
                    and entry.properties.dtype == torch.uint8
                    and len(entry.size) == dims
                    and 0 < entry.size.numel() <= MAX_RNG_BYTES
                ):
                    raise _Unreadable(f"its {key} is not an RNG state")
                rng[kind] = torch.empty(entry.size, dtype=torch.uint8)
        state: dict[str, Any] = {
            "model": model,
            "loop": {"step": step},
            "rng": {f"rank{self.rank}": rng} if rng else {},
        }
        if self.optimizers:
            state["optim"] = optim
        if self.servers is not None:
            state["servers"] = param_server.checkpoint_state(self.model, load=load)
        if load:
            state["globalized"] = globalized
        return state

    # ---- agreement between ranks ------------------------------------------------------

    def _broadcast(self, value: Any) -> Any:
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _agree(self, error: str | None) -> None:
        """Raise on every rank if any rank failed (so no rank waits for one that stopped)."""
        errors = [error]
        if self.group is not None:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise CheckpointError(first)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _warn(message: str) -> None:
    """A warning pointing at the program's line (the loop or the call), not at this module."""
    level, frame = 2, sys._getframe(1)  # 1: this function; 2: its caller
    while frame is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, stacklevel=level)


# ---- the checkpoint directory (rank 0's side) ---------------------------------------------


def _writable_error(root: Path, rank: int) -> str | None:
    """Why this rank can't write checkpoints under ``root`` (None if it can)."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o755)  # not group-writable under umask 002
        with tempfile.NamedTemporaryFile(dir=root, prefix=f".probe-rank{rank}-"):
            pass
    except OSError as e:
        return (
            f"checkpoint directory {str(root)!r} is not writable (rank {rank}): {e.strerror or e}"
        )
    return None


def step_dirs(root: Path) -> list[Path]:
    """Everything named like a checkpoint folder under ``root`` (links included), oldest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is itself a checkpoint folder (named step_N, or holding a marker)."""
    return _step_of(path) is not None or os.path.lexists(path / MARKER)


def examine(path: Path, *, deep: bool = False) -> tuple[str, str]:
    """What the step folder ``path`` is (COMPLETE, PARTIAL or UNUSABLE) and why, in a line.

    ``deep``: also read its ``.metadata`` (as a load would, with the restricted unpickler).
    A folder, or a file in it, that is not the user's is UNUSABLE even without a marker:
    it is never read and never deleted.
    """
    why = folder_error(path)
    if why is not None:
        return UNUSABLE, why
    try:
        data = read_regular(path / MARKER, MAX_MARKER_BYTES)
    except FileNotFoundError:
        return PARTIAL, "no completion marker (the save did not finish)"
    except Unusable as e:
        return UNUSABLE, f"unreadable completion marker: {e}"
    why = _marker_error(data, _step_of(path))
    if why is None:
        why = _sizes_error(path, data)
    if why is None and deep:
        try:
            read_metadata(path)
        except (Unusable, OSError) as e:
            why = f"its .metadata can't be read: {one_line(e)}"
    return (UNUSABLE, why) if why is not None else (COMPLETE, "complete")


def _marker_error(data: bytes, step: int | None) -> str | None:
    """Why the marker's JSON is not what write_marker writes (None if it is): every field typed."""
    try:
        marker = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested 100,000 deep
        return f"unreadable completion marker: {str(e).splitlines()[0] if str(e) else 'too deep'}"
    if not isinstance(marker, dict):
        return "completion marker is not a JSON object"

    def whole(value: Any, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    if marker.get("format") != FORMAT or not whole(marker.get("format"), 1):
        return f"completion marker has format {marker.get('format')!r}, not {FORMAT}"
    if not whole(marker.get("step"), 0) or (step is not None and marker["step"] != step):
        return f"completion marker has step {marker.get('step')!r}, not {step}"
    if not whole(marker.get("world_size"), 1):
        return f"completion marker has world_size {marker.get('world_size')!r}"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "completion marker lists no files"
    for name, size in files.items():
        if name in (".", "..", MARKER) or "/" in name or "\0" in name:
            return f"completion marker lists {name!r}, not a file of the folder"
        if not whole(size, 0):
            return f"completion marker gives {name} the size {size!r}, not a number of bytes"
    return None


def _sizes_error(path: Path, data: bytes) -> str | None:
    """Why the files are not as the save wrote them (None if they are); the marker is valid."""
    for name, size in sorted(json.loads(data)["files"].items()):
        try:
            actual = os.lstat(path / name).st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the save wrote {size}"
    return None


def _survey(root: Path) -> list[tuple[int, str, str]]:
    """(step, state, why) of every step folder under ``root``, newest first."""
    return [(_step_of(p) or 0, *examine(p)) for p in reversed(step_dirs(root))]


def find_checkpoints(root: Path) -> tuple[list[int], list[tuple[str, str]]]:
    """Steps of the complete checkpoints, newest first, and the newer folders skipped (why)."""
    complete: list[int] = []
    skipped: list[tuple[str, str]] = []
    for step, state, why in _survey(root):
        if state == COMPLETE:
            complete.append(step)
        elif not complete:  # only folders newer than the one resumed from matter
            skipped.append((str(step_dir(root, step)), why))
    return complete, skipped


def check_complete(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete and intact (None if it is)."""
    state, why = examine(path)
    return None if state == COMPLETE else why


def _none_usable(root: Path, unusable: dict[int, str]) -> str:
    """The error when checkpoints exist and none can be used (none is deleted)."""
    listed = [f"{step_dir(root, s).name}: {why}" for s, why in sorted(unusable.items())[::-1][:3]]
    more = f"; and {len(unusable) - 3} more" if len(unusable) > 3 else ""
    return (
        f"no checkpoint under {str(root)!r} can be used ({'; '.join(listed)}{more});"
        f" nothing was deleted: repair or move them, or pass fresh=True ({FRESH_ENV}=1)"
        " to start at step 0"
    )


def write_marker(path: Path, step: int, world_size: int) -> None:
    """Mark ``path`` complete: a JSON file written to a temporary name, fsynced, renamed."""
    _writable_by_owner_only(path)
    sizes = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    sizes.pop(MARKER, None)
    text = json.dumps(
        {"format": FORMAT, "step": step, "world_size": world_size, "files": sizes}, indent=1
    )
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{MARKER}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; the checkpoint's other files are not
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MARKER)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path)


def _writable_by_owner_only(path: Path) -> None:
    """Take group and other write permission off the folder DCP wrote and its files, which a
    umask of 002 gives them: a checkpoint others can write is refused at the next start."""
    for p in (path, *path.iterdir()):
        try:
            mode = os.lstat(p).st_mode
            if mode & 0o022 and not stat.S_ISLNK(mode):
                os.chmod(p, stat.S_IMODE(mode) & ~0o022)
        except OSError:
            pass  # another user's file: refused, with its name, when it is read


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(root: Path, keep: int) -> None:
    """Delete the folders older than the ``keep`` newest complete checkpoints, except unusable
    ones (never deleted) and links (never followed)."""
    survey = _survey(root)[::-1]  # oldest first
    complete = [step for step, state, _ in survey if state == COMPLETE]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for step, state, _ in survey:
        if step < oldest_kept and state != UNUSABLE:
            _remove(step_dir(root, step))


def _remove(path: Path) -> None:
    """Delete a step folder; a link (or anything not a folder) is left alone, never followed."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return
        # The marker goes first: a folder half deleted is then merely incomplete.
        if stat.S_ISREG(os.lstat(path / MARKER).st_mode):
            os.unlink(path / MARKER)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)  # rmtree does not follow links inside


def _set_aside(path: Path) -> None:
    """Move an unusable checkpoint out of the way of the saves (renamed, links included)."""
    for n in range(1, 1000):
        aside = path.with_name(path.name + SET_ASIDE + (f"-{n}" if n > 1 else ""))
        if not os.path.lexists(aside):
            break
    try:
        os.rename(path, aside)
    except OSError as e:
        raise CheckpointError(
            f"can't move the unusable checkpoint {path} out of the way: {e.strerror or e}"
        ) from None
    _warn(f"kept the unusable checkpoint {path} as {aside.name}")


# ---- model mismatch ----------------------------------------------------------------------


def _check_same_model(path: Path, state: dict[str, Any], metadata: Metadata) -> None:
    """A clear error naming the first key where this model and the checkpoint differ."""
    # (server tables: worker 0 alone loads the rows, so only what this rank asks for is checked)
    flat, _ = flatten_state_dict({k: state[k] for k in ("model", "optim", "servers") if k in state})
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if key not in saved:
            raise CheckpointError(
                f"checkpoint {path} is from a different model: it has no {key!r}{_near(key, saved)}"
            )
        entry = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            shape = tuple(getattr(value, "shape", ()))
            if hasattr(value, "device_mesh"):  # a DTensor: compare the global shape
                shape = tuple(value.size())
            if tuple(entry.size) != shape:
                raise CheckpointError(
                    f"checkpoint {path} is from a different model: {key!r} has shape"
                    f" {tuple(entry.size)} there and {shape} here"
                )
    prefixes = ("model.", "optim.") if "optim" in state else ("model.",)
    for key in saved:
        if key.startswith(prefixes) and key not in flat:
            raise CheckpointError(
                f"checkpoint {path} is from a different model: it has {key!r}, which this"
                " model does not"
            )


def _near(key: str, saved: Any) -> str:
    head = key.split(".", 1)[0] + "."
    same_kind = [k for k in saved if k.startswith(head)]
    return f" (it has {same_kind[0]!r}, ...)" if same_kind else ""


# ---- conversion (``macrogen checkpoint convert``) -------------------------------------------


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    complete, _ = find_checkpoints(root)
    return step_dir(root, complete[0]) if complete else None


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], *, model_only: bool) -> Path:
    """Write a DCP checkpoint as one ``torch.save`` file, for loading without torch.distributed.

    ``src`` is a checkpoint folder (``ckpt/step_00000050``) or a directory of them (its
    newest complete one). The file holds ``{"model", "optim", "loop", "rng"}`` as
    ``get_state_dict`` gave them, or with ``model_only`` the model's state_dict alone
    (``model.load_state_dict(torch.load(out))``). ``out`` is replaced whole or not at
    all (written beside it, then renamed). Returns the folder converted.
    """
    path = Path(src)
    if not is_step_dir(path):
        why = root_error(path)
        if why is not None:
            raise CheckpointError(f"refusing to read checkpoints under {str(path)!r}: {why}")
        found = latest(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {str(path)!r}")
        path = found
    state, why = examine(path)
    if state != COMPLETE:
        raise CheckpointError(f"checkpoint {str(path)!r} is not complete: {why}")
    whole: dict[str, Any] = {}
    try:
        metadata = read_metadata(path)
    except (Unusable, OSError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} can't be read: {one_line(e)}") from None
    try:  # as dcp_to_torch_save reads it (dcp.load would fill a copy), byte items weights_only
        _load_state_dict(
            whole,
            storage_reader=SafeReader(path, metadata),
            planner=SafeEmptyLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except (Exception, CheckpointException) as e:  # the files are data from disk: any failure
        raise CheckpointError(f"checkpoint {str(path)!r} can't be read: {one_line(e)}") from None
    if model_only and not isinstance(whole.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model")
    _save_atomic(whole["model"] if model_only else whole, Path(out))
    return path


def _save_atomic(obj: Any, out: Path) -> None:
    """torch.save ``obj`` to ``out``: readers see the old file or the new, never half of one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        files.write_atomic(out, buffer.getvalue())  # staged beside OUT, renamed
    except files.WriteError as e:  # a directory, a read-only file: it says so itself
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"can't write {out}: {e.strerror or e}") from None


# ---- why a save failed --------------------------------------------------------------------


def _save_cause(path: Path, e: BaseException) -> str | None:
    """The disk's reason a save failed, in one line (None if the disk is not the reason)."""
    error = storage_error(e)
    free = free_bytes(path)
    full = error is not None and error.errno == errno.ENOSPC
    if full or (short_write(e) and free is not None and free < LOW_SPACE):
        return "no space left on device" + (f" ({free} bytes free)" if free is not None else "")
    if error is not None:
        return one_line(error)
    if short_write(e):
        return f"a file was written short ({one_line(e)}): is the disk full, or over quota?"
    return None
