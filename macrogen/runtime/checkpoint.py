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

A pipelined model's ranks each save their stage's entries under the serial names
(``checkpoint_state``: the optimizer state flattened per parameter), so a checkpoint
holds the serial model's keys and loads into any stage count; a load compares the
checkpoint's keys with the union of the stages' keys.

(``checkpoint_dir``: the folders, markers and pruning; ``checkpoint_state``: what
a checkpoint holds of the model and optimizers; ``checkpoint_files``: reading
files that are data, safely; ``checkpoint_convert``: one ``torch.save`` file.)
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
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

from macrogen.runtime import checkpoint_state, groups, param_server
from macrogen.runtime.checkpoint_dir import (
    COMPLETE,
    FRESH_ENV,
    UNUSABLE,
    CheckpointError,
    none_usable,
    prune,
    remove,
    set_aside,
    step_dir,
    survey_dir,
    warn,
    writable_error,
    write_marker,
)
from macrogen.runtime.checkpoint_files import (
    SafeLoadPlanner,
    SafeReader,
    Unusable,
    free_bytes,
    one_line,
    read_metadata,
    root_error,
    short_write,
    storage_error,
)

T = TypeVar("T")

# Serially DCP says, on every save and load, that it assumes one process: it does.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

ON_SAVE_ERROR = ("error", "warn")
LOW_SPACE = 1 << 20  # bytes free under which a short write is put down to a full disk
MAX_RNG_BYTES = 1 << 20  # torch's CPU RNG state is 5056 bytes, CUDA's 16 per device


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
        self._agree(writable_error(root, self.rank) or root_error(root))
        survey: list[tuple[int, str, str]] = self._broadcast(
            survey_dir(root) if self.rank == 0 else None
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
                    raise CheckpointError(none_usable(root, unusable))
        if self.rank == 0:
            # Folders past the starting point would be written again by this run: a partial
            # save (or, with fresh, a checkpoint) is deleted, an unusable one set aside.
            for step, _, _ in survey:
                if step <= start:
                    continue
                if step in unusable:
                    set_aside(step_dir(root, step))
                else:
                    remove(step_dir(root, step))
        self._barrier()
        return start

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warn(message)

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
        loading = state.pop("loading")
        prefixes = _prefixes(state)
        asked = self._every_stage({k for k in _keys(state) if k.startswith(prefixes)})
        self._agree(_mismatch(path, state, metadata, asked))  # (stages may see it differently)
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
            self.model, self.optimizers, state["model"], state.get("optim", {}), loading
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
            remove(path)
        if cause is None:  # not the disk: a bug, raised as it is
            raise e
        message = f"can't save checkpoint {path}: {cause}"
        if self.config.on_save_error == "warn":
            warn(f"{message}; training goes on from the last complete one")
            return
        raise CheckpointError(message) from None

    # ---- state --------------------------------------------------------------------

    def _state(self, step: int, metadata: Metadata | None = None) -> dict[str, Any]:
        """What a checkpoint holds; for a load (``metadata``), RNG slots shaped as saved, the
        optimizer state in the layout the checkpoint has, and under ``"loading"`` what
        ``checkpoint_state.set_state`` needs to put the values in place."""
        load = metadata is not None
        flat = metadata is None or checkpoint_state.NESTED_KEY not in metadata.state_dict_metadata
        model, optim, loading = checkpoint_state.get_state(
            self.model, self.optimizers, load=load, flat=flat
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
            state["loading"] = loading
        return state

    def _every_stage(self, keys: set[str]) -> set[str]:
        """The keys every rank asks for: a pipeline stage asks for its own parameters' only,
        so the first rank of each stage shows its keys to all (other ranks of a stage ask
        for the same)."""
        from macrogen.runtime.pipeline import pipeline_of

        pipe = pipeline_of(self.model)
        if pipe is None or pipe.layout is None or self.group is None:
            return keys
        lay = pipe.layout
        first = dist.get_rank() % (lay.data_size * lay.tensor_size) == 0
        shown: list[Any] = [None] * self.world_size
        dist.all_gather_object(shown, keys if first else None, group=self.group)
        return set().union(*(k for k in shown if k is not None))

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


# ---- model mismatch ----------------------------------------------------------------------


def _mismatch(path: Path, state: dict[str, Any], metadata: Metadata, asked: set[str]) -> str | None:
    """A clear error naming the first key where this model and the checkpoint differ, or None.

    ``asked``: the model and optimizer keys of every rank's state (a pipeline's stages hold
    different parameters: the checkpoint holds their union)."""
    flat = _keys(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if key not in saved:
            return (
                f"checkpoint {path} is from a different model: it has no {key!r}{_near(key, saved)}"
            )
        entry = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            shape = tuple(getattr(value, "shape", ()))
            if hasattr(value, "device_mesh"):  # a DTensor: compare the global shape
                shape = tuple(value.size())
            if tuple(entry.size) != shape:
                return (
                    f"checkpoint {path} is from a different model: {key!r} has shape"
                    f" {tuple(entry.size)} there and {shape} here"
                )
    prefixes = _prefixes(state)
    for key in saved:
        if key.startswith(prefixes) and key not in asked:
            return f"checkpoint {path} is from a different model: it has {key!r}, which this model does not"
    return None


def _keys(state: dict[str, Any]) -> dict[str, Any]:
    """The state's entries as DCP keys them."""
    # (server tables: worker 0 alone loads the rows, so only what this rank asks for is checked)
    flat, _ = flatten_state_dict({k: state[k] for k in ("model", "optim", "servers") if k in state})
    return flat


def _prefixes(state: dict[str, Any]) -> tuple[str, ...]:
    """The keys a checkpoint must not hold more of than the model asks for."""
    return ("model.", "optim.") if "optim" in state else ("model.",)


def _near(key: str, saved: Any) -> str:
    head = key.split(".", 1)[0] + "."
    same_kind = [k for k in saved if k.startswith(head)]
    return f" (it has {same_kind[0]!r}, ...)" if same_kind else ""


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
