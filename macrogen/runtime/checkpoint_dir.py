"""The checkpoint directory of ``resumable``: one folder per step, a marker, pruning.

    ckpt/step_00000050/.metadata, __0_0.distcp, __1_0.distcp, ...   written by DCP
    ckpt/step_00000050/macrogen_complete.json                      written last, by rank 0

A folder counts once its marker is there (written to a temporary name, fsynced,
renamed) and every file it lists has the size it lists: ``examine`` says what a
folder is (COMPLETE, PARTIAL: a save that did not finish, UNUSABLE: a marker but
something wrong, or a file that is not the user's, never read and never
deleted). Rank 0 writes the markers, prunes to the ``keep`` newest complete
checkpoints and sets unusable ones aside; the files themselves are read through
``checkpoint_files``' checks.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from macrogen.runtime.checkpoint_files import (
    MAX_MARKER_BYTES,
    Unusable,
    folder_error,
    one_line,
    read_metadata,
    read_regular,
)

MARKER = "macrogen_complete.json"
PREFIX = "step_"
FORMAT = 1  # version of the marker's contents
SET_ASIDE = ".unreadable"  # suffix of an unusable checkpoint moved out of a save's way
FRESH_ENV = "MACROGEN_FRESH"  # 1: start over at step 0, as fresh=True

# What examine() says of a step folder
COMPLETE = "complete"  # marker and files as the save wrote them
PARTIAL = "partial"  # no marker: a save that did not finish (deleted when in the way)
UNUSABLE = "unusable"  # a marker, but it can't be used: kept, never deleted


class CheckpointError(RuntimeError):
    """A checkpoint directory that can't be used: unwritable, or from another model."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a folder named step_<ASCII digits> (not '²', which isdigit() takes)."""
    tail = path.name[len(PREFIX) :]
    ok = path.name.startswith(PREFIX) and 0 < len(tail) <= 18 and tail.isascii() and tail.isdigit()
    return int(tail) if ok else None


def warn(message: str) -> None:
    """A warning pointing at the program's line (the loop or the call), not at this module."""
    level, frame = 2, sys._getframe(1)  # 1: this function; 2: its caller
    while frame is not None and _ours(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, stacklevel=level)


def _ours(filename: str) -> bool:
    """A frame of the checkpoint modules (this one, the loop's, the conversion's)."""
    path = Path(filename)
    return path.parent == Path(__file__).parent and path.name.startswith("checkpoint")


# ---- rank 0's side -----------------------------------------------------------------------


def writable_error(root: Path, rank: int) -> str | None:
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
    found = [(s, p) for p in root.iterdir() if (s := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is itself a checkpoint folder (named step_N, or holding a marker)."""
    return step_of(path) is not None or os.path.lexists(path / MARKER)


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
    why = _marker_error(data, step_of(path))
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


def survey_dir(root: Path) -> list[tuple[int, str, str]]:
    """(step, state, why) of every step folder under ``root``, newest first."""
    return [(step_of(p) or 0, *examine(p)) for p in reversed(step_dirs(root))]


def find_checkpoints(root: Path) -> tuple[list[int], list[tuple[str, str]]]:
    """Steps of the complete checkpoints, newest first, and the newer folders skipped (why)."""
    complete: list[int] = []
    skipped: list[tuple[str, str]] = []
    for step, state, why in survey_dir(root):
        if state == COMPLETE:
            complete.append(step)
        elif not complete:  # only folders newer than the one resumed from matter
            skipped.append((str(step_dir(root, step)), why))
    return complete, skipped


def check_complete(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete and intact (None if it is)."""
    state, why = examine(path)
    return None if state == COMPLETE else why


def none_usable(root: Path, unusable: dict[int, str]) -> str:
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
    survey = survey_dir(root)[::-1]  # oldest first
    complete = [step for step, state, _ in survey if state == COMPLETE]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for step, state, _ in survey:
        if step < oldest_kept and state != UNUSABLE:
            remove(step_dir(root, step))


def remove(path: Path) -> None:
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


def set_aside(path: Path) -> None:
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
    warn(f"kept the unusable checkpoint {path} as {aside.name}")


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    complete, _ = find_checkpoints(root)
    return step_dir(root, complete[0]) if complete else None
