"""The import hook's cache: expanded code and its bytecode, found by path, trusted by content.

One entry per source file and target, beside the source (or mirrored under
``MACROGEN_CACHE_DIR``, as ``PYTHONPYCACHEPREFIX`` does for ``.pyc`` files)::

    __pycache__/train.macrogen-any.cpython-311.mgc   key + checksum + marshalled code
    __pycache__/train.macrogen-any.py                the expanded code, for people to read

An ``.mgc`` file is ``MAGIC | key | payload length | payload sha256 | payload``.
The key hashes everything the expansion depends on (the source bytes, its path,
macrogen's version, the bytecode version, the target and the tuning values), never
an mtime: touching a file keeps its entry, editing it or retuning replaces it.
A short, truncated or garbled file fails the length or checksum test and is
rebuilt; it is never unmarshalled, let alone executed. Entries are written with
temp file + rename, so ranks that expand the same module at once all succeed and
leave one whole entry.

*Whose code runs.* The key and checksum are computable from public facts, so
they authenticate nothing: an entry is used only if it, and every directory from
the cache root down to it, belongs to the current user and is not writable by
group or others (``trust``). Anything else is ignored (the module is expanded
afresh and nothing is written there), with one warning per directory. Cache
directories are created with mode 0700.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import marshal
import os
import stat
import struct
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from macrogen import __version__

MAGIC = b"MGCACHE1"
HEADER = struct.Struct("<8s32sQ32s")  # magic, key, payload length, payload sha256
ENTRY_SUFFIX = ".mgc"
MARKER = ".macrogen-"  # every cache file name has it: what `cache clear` looks for


class Entry(NamedTuple):
    code: types.CodeType  # the module's code, ready to exec
    expanded: str | None  # the expanded source; None when the module has no macro sites
    sites: tuple[tuple[str, int], ...]  # (macro, source line) of each expanded site


class Location(NamedTuple):
    entry: Path  # the .mgc file
    expanded: Path  # the readable expanded code beside it


def locate(source: Path, *, target: str | None, cache_dir: Path | None) -> Location:
    """Where the entry of ``source`` lives (``source`` is absolute)."""
    if cache_dir is None:
        folder = source.parent / "__pycache__"
    else:
        # mirror the source's directory, as sys.pycache_prefix does
        folder = Path(cache_dir) / source.parent.relative_to(source.parent.anchor)
    stem = f"{source.stem}{MARKER}{target or 'any'}"
    tag = sys.implementation.cache_tag or "python"
    return Location(folder / f"{stem}.{tag}{ENTRY_SUFFIX}", folder / f"{stem}.py")


def key(source: bytes, *, path: Path, target: str | None, tuning: Mapping[str, Any]) -> bytes:
    """What the expansion depends on, hashed: change any of it and the entry is rebuilt."""
    h = hashlib.sha256()
    for part in (
        b"macrogen-hook-1",
        __version__.encode(),
        importlib.util.MAGIC_NUMBER,  # bytecode of another Python is no use
        os.fsencode(path),  # code objects name the file; a moved tree re-expands
        (target or "").encode(),
        json.dumps(tuning, sort_keys=True, default=repr).encode(),
        source,
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _ours(st: os.stat_result) -> bool:
    """Owned by the current user, and no one else may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def trust(location: Location, cache_dir: Path | None) -> str | None:
    """None if the entry's directories may be trusted; else why not (a sentence).

    Checked: every directory from the cache root down to the entry's folder (the
    ``__pycache__`` folder beside the source, or the mirrored folders under
    ``MACROGEN_CACHE_DIR``). The cache root itself may be shared if it is sticky
    (like /tmp): others can't then move our folders in it.
    """
    folder = location.entry.parent
    root = Path(cache_dir) if cache_dir is not None else folder
    chain = [folder, *folder.parents]
    chain = chain[: chain.index(root) + 1] if root in chain else [folder]
    for directory in chain:
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            continue  # not made yet: write() makes it, ours and 0700
        except OSError as e:
            return f"{directory} can't be examined ({e.strerror or e})"
        if stat.S_ISLNK(st.st_mode):
            st = os.stat(directory)
        shared_root = directory == root and cache_dir is not None and st.st_mode & stat.S_ISVTX
        if not _ours(st) and not shared_root:
            owner = "another user" if st.st_uid != os.geteuid() else "you"
            return (
                f"{directory} belongs to {owner} and mode {stat.filemode(st.st_mode)}:"
                " a cache folder must be yours and writable by you alone"
            )
    return None


def read(path: Path, expected_key: bytes) -> tuple[Entry | None, str]:
    """The entry at ``path`` if it is whole, ours and for ``expected_key``; else None and why not.

    The reason is "hit", "missing", "stale" (another key: the source, options or
    macrogen changed), "corrupt" (short, garbled) or "untrusted" (owned by another
    user, or writable by others: never unmarshalled).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None, "missing"
    except OSError:
        return None, "corrupt"
    try:
        st = os.fstat(fd)  # the file we opened, not whatever the path names now
        if not stat.S_ISREG(st.st_mode) or not _ours(st):
            return None, "untrusted"
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError:
        return None, "corrupt"
    finally:
        os.close(fd)
    if len(data) < HEADER.size:
        return None, "corrupt"
    magic, entry_key, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        return None, "corrupt"
    if entry_key != expected_key:
        return None, "stale"
    payload = memoryview(data)[HEADER.size :]
    if len(payload) != length or hashlib.sha256(payload).digest() != digest:
        return None, "corrupt"
    try:
        code, expanded, sites = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return None, "corrupt"
    if not isinstance(code, types.CodeType) or not isinstance(expanded, (str, type(None))):
        return None, "corrupt"
    return Entry(code, expanded, tuple(tuple(s) for s in sites)), "hit"


def write(location: Location, entry_key: bytes, entry: Entry) -> None:
    """Write both files atomically: concurrent writers of one key write the same bytes."""
    from macrogen.files import write_atomic  # only the cold path needs tempfile

    _make_private(location.entry.parent)
    if entry.expanded is not None:
        write_atomic(location.expanded, entry.expanded.encode("utf-8"), mode=0o644)
    else:
        location.expanded.unlink(missing_ok=True)  # left by a version that had sites
    payload = marshal.dumps((entry.code, entry.expanded, tuple(entry.sites)))
    header = HEADER.pack(MAGIC, entry_key, len(payload), hashlib.sha256(payload).digest())
    write_atomic(location.entry, header + payload, mode=0o644)  # never writable by others


def _make_private(folder: Path) -> None:
    """Create ``folder`` and its missing parents with mode 0700."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask


# -- `macrogen cache clear | info` -------------------------------------------------------
def cache_files(trees: list[Path], cache_dirs: list[Path] = ()) -> Iterator[Path]:
    """macrogen's cache files: entries, expanded code and left-over temp files.

    In a source tree only ``__pycache__`` folders are searched, and only macrogen's
    files in them (the interpreter's own ``.pyc`` files stay); a cache directory
    (``MACROGEN_CACHE_DIR``) is searched whole.
    """
    seen: set[Path] = set()
    for root, whole in [(t, False) for t in trees] + [(c, True) for c in cache_dirs]:
        if not root.is_dir():
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in (".git", ".venv", "node_modules")]
            if not whole and Path(folder).name != "__pycache__":
                continue
            for name in files:
                path = Path(folder) / name
                if MARKER in name and _is_cache_file(name) and path not in seen:
                    seen.add(path)
                    yield path


def _is_cache_file(name: str) -> bool:
    if name.startswith("."):  # write_atomic's temp files: .<name>.<random>.tmp
        return name.endswith(".tmp")
    return name.endswith((ENTRY_SUFFIX, ".py"))


def clear(trees: list[Path], cache_dirs: list[Path] = ()) -> tuple[int, int]:
    """Remove macrogen's cache files (see ``cache_files``); returns (files, bytes) removed."""
    count = size = 0
    for path in list(cache_files(trees, cache_dirs)):
        try:
            n = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        count += 1
        size += n
    return count, size
