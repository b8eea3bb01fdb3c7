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
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
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
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from macrogen.runtime import checkpoint_state, groups

T = TypeVar("T")

# Serially DCP says, on every save and load, that it assumes one process: it does.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

MARKER = "macrogen_complete.json"
PREFIX = "step_"
FORMAT = 1  # version of the marker's contents


class CheckpointError(RuntimeError):
    """A checkpoint directory that can't be used: unwritable, or from another model."""


class _Unreadable(Exception):
    """A checkpoint that looked complete but can't be loaded: the previous one is tried."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Path  # one folder per checkpoint below it: step_00000050/
    every: int  # save after every `every` steps
    keep: int  # complete checkpoints kept; older ones are deleted


def resumable(
    iterable: Iterable[T],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    dir: str | os.PathLike[str],
    every: int,
    keep: int = 2,
) -> Iterator[T]:
    """The items of ``iterable``, resumed from and checkpointed to ``dir``.

    Runs the start-up at the call (a read-only ``dir`` or a checkpoint of another
    model fails here, not at the first save), then returns the loop's iterator.
    Every rank of the job must call it at the same point.
    """
    config = _config(dir, every, keep)
    loop = _Checkpointer(config, model, _optimizers(optimizer))
    start = loop.start()
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


def _config(dir: Any, every: Any, keep: Any) -> CheckpointConfig:
    for name, value in (("every", every), ("keep", keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"resumable(): {name} must be a whole number >= 1, not {value!r}")
    if not isinstance(dir, (str, os.PathLike)) or not str(dir):
        raise ValueError(f"resumable(): dir must be a path, not {dir!r}")
    return CheckpointConfig(Path(dir), every, keep)


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
    tail = path.name[len(PREFIX) :]
    return int(tail) if path.name.startswith(PREFIX) and tail.isdigit() else None


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
        # A group of its own: DCP's background thread runs collectives while the
        # training loop runs its own on the default group.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.pending: tuple[int, Future[Any]] | None = None  # (step, future) of the save in flight
        self.rng: dict[str, torch.Tensor] = {}  # this rank's RNG states from the loaded checkpoint

    # ---- start-up ---------------------------------------------------------------

    def start(self) -> int:
        """Check ``dir`` is writable, load the latest complete checkpoint; the step to start at."""
        self._agree(_writable_error(self.config.dir, self.rank))
        candidates, skipped = self._broadcast(
            find_checkpoints(self.config.dir) if self.rank == 0 else None
        )
        if self.rank == 0:
            for path, why in skipped:
                warnings.warn(f"skipping checkpoint {path}: {why}", stacklevel=3)
        start = 0
        for step in candidates:
            path = step_dir(self.config.dir, step)
            try:
                start = self._load(path)
            except _Unreadable as e:  # alike on every rank: one file, or DCP's gathered failures
                if self.rank == 0:
                    warnings.warn(f"skipping checkpoint {path}: {e}", stacklevel=3)
                continue
            break
        if self.rank == 0:
            # Folders past the starting point are partial or unreadable, and would be
            # written again by this run: clear them before any rank saves there.
            for path in step_dirs(self.config.dir):
                if (_step_of(path) or 0) > start:
                    _remove(path)
        self._barrier()
        return start

    def _load(self, path: Path) -> int:
        """Load the checkpoint at ``path`` into the model and optimizers; its step."""
        try:
            metadata = dcp.FileSystemReader(path).read_metadata()
        except Exception as e:
            raise _Unreadable(f"its .metadata can't be read: {e}") from e
        state = self._state(0, metadata=metadata)
        _check_same_model(path, state, metadata)
        globalized = state.pop("globalized")
        try:
            dcp.load(
                state, checkpoint_id=path, process_group=self.group, no_dist=self.group is None
            )
        except CheckpointException as e:
            raise _Unreadable(f"DCP can't read it: {e}") from e
        checkpoint_state.set_state(
            self.model, self.optimizers, state["model"], state.get("optim", {}), globalized
        )
        self.rng = state["rng"].get(f"rank{self.rank}", {})
        return int(state["loop"]["step"])

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
        future = dcp.async_save(
            self._state(step),
            checkpoint_id=path,
            process_group=self.group,
            no_dist=self.group is None,
        )
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
        future.result()  # a failed save raises here, on every rank
        if self.rank == 0:
            write_marker(step_dir(self.config.dir, step), step, self.world_size)
            prune(self.config.dir, self.config.keep)

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
            for kind in ("cpu", "cuda"):
                entry = metadata.state_dict_metadata.get(f"rng.rank{self.rank}.{kind}")
                if isinstance(entry, TensorStorageMetadata):
                    rng[kind] = torch.empty(entry.size, dtype=entry.properties.dtype)
        state: dict[str, Any] = {
            "model": model,
            "loop": {"step": step},
            "rng": {f"rank{self.rank}": rng} if rng else {},
        }
        if self.optimizers:
            state["optim"] = optim
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


# ---- the checkpoint directory (rank 0's side) ---------------------------------------------


def _writable_error(root: Path, rank: int) -> str | None:
    """Why this rank can't write checkpoints under ``root`` (None if it can)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=f".probe-rank{rank}-"):
            pass
    except OSError as e:
        return (
            f"checkpoint directory {str(root)!r} is not writable (rank {rank}): {e.strerror or e}"
        )
    return None


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def find_checkpoints(root: Path) -> tuple[list[int], list[tuple[str, str]]]:
    """Steps of the complete checkpoints, newest first, and the newer folders skipped (why)."""
    complete: list[int] = []
    skipped: list[tuple[str, str]] = []
    for path in reversed(step_dirs(root)):
        why = check_complete(path)
        if why is None:
            complete.append(_step_of(path) or 0)
        elif not complete:  # only folders newer than the one resumed from matter
            skipped.append((str(path), why))
    return complete, skipped


def check_complete(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete and intact (None if it is)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return "no completion marker (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable completion marker: {e}"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or ".metadata" not in files:
        return "completion marker lists no files"
    for name, size in sorted(files.items()):
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the save wrote {size}"
    return None


def write_marker(path: Path, step: int, world_size: int) -> None:
    """Mark ``path`` complete: a JSON file written to a temporary name, fsynced, renamed."""
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    files.pop(MARKER, None)
    text = json.dumps(
        {"format": FORMAT, "step": step, "world_size": world_size, "files": files}, indent=1
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
    """Delete every folder older than the ``keep`` newest complete checkpoints."""
    complete = [p for p in step_dirs(root) if check_complete(p) is None]
    if len(complete) <= keep:
        return
    oldest_kept = _step_of(complete[-keep]) or 0
    for path in step_dirs(root):
        if (_step_of(path) or 0) < oldest_kept:
            _remove(path)


def _remove(path: Path) -> None:
    # The marker goes first: a folder half deleted is then merely incomplete.
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


# ---- model mismatch ----------------------------------------------------------------------


def _check_same_model(path: Path, state: dict[str, Any], metadata: Metadata) -> None:
    """A clear error naming the first key where this model and the checkpoint differ."""
    flat, _ = flatten_state_dict({k: state[k] for k in ("model", "optim") if k in state})
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
    (``model.load_state_dict(torch.load(out))``). Returns the folder converted.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(src)
    if _step_of(path) is None:
        found = latest(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {str(path)!r}")
        path = found
    why = check_complete(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is not complete: {why}")
    if not model_only:
        dcp_to_torch_save(path, out)
        return path
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(path, whole)
        torch.save(torch.load(whole, weights_only=False)["model"], out)
    return path
