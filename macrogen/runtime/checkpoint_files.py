"""Reading a checkpoint folder without letting it run code, hang or escape the folder.

A DCP checkpoint is made of pickles: ``.metadata`` is one, and each non-tensor item
(``loop.step``, an optimizer's ``lr``) is a ``torch.save`` of its value. DCP reads
the first with ``pickle.load`` and the others with ``torch.load(weights_only=False)``,
so whoever can write a checkpoint folder could run code in the job that loads it.
Here a checkpoint is data and nothing else:

- ``.metadata`` is unpickled by an unpickler that makes only DCP's metadata classes,
  ``torch.Size``, dtypes and layouts (``_MetadataUnpickler``), and what it made is
  checked for the types DCP relies on (``_check_metadata``);
- byte items are loaded with ``torch.load(weights_only=True)`` (``SafeLoadPlanner``);
  tensors are already (DCP's ``FileSystemReader``);
- a folder is used only if it, its files and the ``dir`` above it belong to you (or
  root) and are not writable by group or others, as the hook cache is (``folder_error``,
  ``root_error``), and only regular files are opened: a FIFO is refused, never waited on.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

METADATA = ".metadata"
MAX_MARKER_BYTES = 1 << 20  # a marker lists one size per file: a few hundred bytes

# What ``.metadata`` may make: DCP's metadata classes (torch 2.13) and the values in them.
_ALLOWED = {
    (Metadata.__module__, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    (_StorageInfo.__module__, "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class Unusable(Exception):
    """A checkpoint folder or file that can't be used; ``str()`` is why (one line)."""


# ---- ownership -----------------------------------------------------------------------------


def _owner_error(path: Path, st: os.stat_result, *, shared_ok: bool = False) -> str | None:
    """Why ``path`` can't be trusted (None if it can): another user's, or writable by others."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to another user (uid {st.st_uid}): a checkpoint must be yours"
    if st.st_mode & 0o022 and not (shared_ok and st.st_mode & stat.S_ISVTX):
        return (
            f"{path} is writable by group or others (mode {stat.filemode(st.st_mode)}):"
            " a checkpoint must be writable by you alone (chmod go-w)"
        )
    return None


def root_error(root: Path) -> str | None:
    """Why the checkpoint ``dir`` can't be trusted (None if it can or does not exist yet).

    A shared sticky folder (like /tmp) is fine: others can't then replace what is yours.
    """
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{root} can't be examined: {e.strerror or e}"
    return _owner_error(root, st, shared_ok=True)


def folder_error(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` can't be trusted (None if it can).

    Checked without following links: the folder, and each entry in it, which must be
    a regular file (DCP writes nothing else there).
    """
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        why = _owner_error(path, st)
        if why is not None:
            return why
        with os.scandir(path) as entries:
            for entry in entries:
                est = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(est.st_mode):
                    return f"{entry.name} is not a regular file"
                why = _owner_error(Path(entry.path), est)
                if why is not None:
                    return why
    except OSError as e:
        return f"{path} can't be examined: {e.strerror or e}"
    return None


# ---- plain reads ---------------------------------------------------------------------------


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a link, FIFO or device); else Unusable."""
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unusable(f"{path.name} is a symbolic link") from None
        raise Unusable(f"{path.name} can't be read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unusable(f"{path.name} is not a regular file")
        if limit is not None and st.st_size > limit:
            raise Unusable(f"{path.name} has {st.st_size} bytes, more than {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise Unusable(f"{path.name} can't be read: {e.strerror or e}") from None
    finally:
        os.close(fd)


# ---- .metadata -----------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(folder: Path) -> Metadata:
    """The checkpoint's ``.metadata``, made only of DCP's metadata classes; else Unusable."""
    data = read_regular(folder / METADATA)
    if not data:
        raise Unusable(f"{METADATA} is empty")
    try:
        metadata: Metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # garbage, a torch.save file, a refused class: all one answer
        raise Unusable(f"{METADATA} is not DCP metadata ({one_line(e)})") from None
    why = _check_metadata(metadata)
    if why is not None:
        raise Unusable(f"{METADATA} is not DCP metadata ({why})")
    return metadata


def _check_metadata(md: Any) -> str | None:
    """Why ``md`` is not metadata DCP can use (None if it is): the fields DCP reads, typed."""
    if not isinstance(md, Metadata):
        return f"a {type(md).__name__}"
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        return "no state_dict_metadata"
    for key, entry in sdm.items():
        if not isinstance(key, str):
            return f"a key {key!r}"
        if isinstance(entry, TensorStorageMetadata):
            props = entry.properties
            if not (
                isinstance(entry.size, torch.Size)
                and isinstance(props, TensorProperties)
                and isinstance(props.dtype, torch.dtype)
                and isinstance(entry.chunks, list)
                and all(
                    isinstance(c, ChunkStorageMetadata)
                    and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size)
                    for c in entry.chunks
                )
            ):
                return f"a malformed entry for {key!r}"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"a {type(entry).__name__} for {key!r}"
    storage = md.storage_data
    if not isinstance(storage, dict):
        return "no storage_data"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "a malformed storage entry"
        name = info.relative_path
        if not isinstance(name, str) or not _plain_name(name):
            return f"a file outside the folder ({name!r})"
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"a malformed storage entry for {index.fqn!r}"
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        return "malformed planner_data"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return "malformed storage_meta"
    return None


def _plain_name(name: str) -> bool:
    """A file name in the folder itself: no separator, no '.' or '..'."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


class SafeReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read by ``read_metadata`` above (never plain pickle).

    ``metadata``: what the caller already read that way (read before DCP runs, so that a
    bad file is one clean error, not DCP's logged tracebacks and per-rank fallback).
    """

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not what resumable writes
            raise Unusable("per-rank metadata files are not supported")
        metadata = self.metadata or read_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, with ``weights_only=True``: plain data, never objects."""
    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's advice to allowlist the global is not for here
        found = re.search(r"WeightsUnpickler error: ([^.\n]*)", str(e))
        why = found.group(1) if found else "not loadable with weights_only=True"
        raise Unusable(f"a stored value is not plain data ({why})") from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with each byte item loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """``dcp_to_torch_save``'s planner (the whole checkpoint), byte items with ``weights_only``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


# ---- one-line causes -----------------------------------------------------------------------


def _causes(e: BaseException) -> list[BaseException]:
    """``e``, the exceptions a CheckpointException gathered from the ranks, and their causes."""
    seen: list[BaseException] = []
    todo = [e]
    while todo and len(seen) < 50:
        x = todo.pop(0)
        if any(x is s for s in seen):
            continue
        seen.append(x)
        if isinstance(x, CheckpointException):
            todo += [exc for exc, _ in x.failures.values() if isinstance(exc, BaseException)]
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    return seen


def one_line(e: BaseException) -> str:
    """What went wrong, in one line: the innermost useful exception, not DCP's tracebacks."""
    causes = _causes(e)
    for x in causes:
        if isinstance(x, Unusable):
            return str(x)
    for x in causes:
        if isinstance(x, OSError) and x.strerror:
            named = isinstance(x.filename, (str, os.PathLike)) and str(x.filename)
            where = f" ({Path(x.filename).name})" if named else ""
            return f"{x.strerror}{where}"
    inner = next((x for x in reversed(causes) if not isinstance(x, CheckpointException)), e)
    text = str(inner).strip().splitlines()
    head = text[0] if text else ""
    return f"{type(inner).__name__}: {head}" if head else type(inner).__name__


def storage_error(e: BaseException) -> OSError | None:
    """The OSError a failed save came from (disk full, quota, I/O), if it came from one."""
    return next((x for x in _causes(e) if isinstance(x, OSError)), None)


def short_write(e: BaseException) -> bool:
    """torch.save's message when the file could not be written whole (usually a full disk)."""
    return any("unexpected pos" in str(x) or "file write failed" in str(x) for x in _causes(e))


def free_bytes(path: Path) -> int | None:
    """Bytes free for this user on the file system of ``path`` (or its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None
