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
import re
import stat
import struct
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
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
    warnings: tuple[str, ...] = ()  # said at every import, warm or cold (a bad tuning winner)


class Location(NamedTuple):
    entry: Path  # the .mgc file
    expanded: Path  # the readable expanded code beside it


def locate(
    source: Path, *, target: str | None, cache_dir: Path | None, device: str | None = None
) -> Location:
    """Where the entry of ``source`` lives (``source`` is absolute). ``device`` names the
    rank's device kind when its tuning values are its kind's own (``rank_tuning``): ranks
    of other kinds keep entries of their own rather than replacing each other's."""
    if cache_dir is None:
        folder = source.parent / "__pycache__"
    else:
        # mirror the source's directory, as sys.pycache_prefix does
        folder = Path(cache_dir) / source.parent.relative_to(source.parent.anchor)
    stem = f"{source.stem}{MARKER}{target or 'any'}" + (f"-{device}" if device else "")
    tag = sys.implementation.cache_tag or "python"
    return Location(folder / f"{stem}.{tag}{ENTRY_SUFFIX}", folder / f"{stem}.py")


def key(source: bytes, *, path: Path, target: str | None, tuning: Mapping[str, Any]) -> bytes:
    """What the expansion depends on, hashed: change any of it and the entry is rebuilt."""
    h = hashlib.sha256()
    for part in (
        b"macrogen-hook-2",  # the entry's layout: 2 added the warnings
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
            # Someone else's link (in a shared, sticky cache root) would send our
            # entries where they chose: only links the user (or root) made are followed.
            if st.st_uid not in (os.geteuid(), 0):
                return (
                    f"{directory} is a symbolic link that belongs to another user:"
                    " a cache folder must be yours and writable by you alone"
                )
            try:
                st = os.stat(directory)
            except OSError as e:
                return f"{directory} can't be examined ({e.strerror or e})"
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
    parsed = _parse(path)
    if isinstance(parsed, str):
        return None, parsed
    entry_key, payload = parsed
    if entry_key != expected_key:
        return None, "stale"
    fields = _unmarshal(payload)
    if fields is None or len(fields) != 4:
        return None, "corrupt"
    code, expanded, sites, warnings = fields
    if (
        not isinstance(code, types.CodeType)
        or not isinstance(expanded, (str, type(None)))
        or not isinstance(warnings, tuple)
        or not all(isinstance(w, str) for w in warnings)
    ):
        return None, "corrupt"
    return Entry(code, expanded, tuple(tuple(s) for s in sites), tuple(warnings)), "hit"


def _parse(path: Path) -> tuple[bytes, memoryview] | str:
    """(key, payload) of a whole entry the current user wrote; else "missing", "untrusted" or "corrupt"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "corrupt"
    try:
        st = os.fstat(fd)  # the file we opened, not whatever the path names now
        if not stat.S_ISREG(st.st_mode) or not _ours(st):
            return "untrusted"
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError:
        return "corrupt"
    finally:
        os.close(fd)
    if len(data) < HEADER.size:
        return "corrupt"
    magic, entry_key, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "corrupt"
    payload = memoryview(data)[HEADER.size :]
    if len(payload) != length or hashlib.sha256(payload).digest() != digest:
        return "corrupt"
    return entry_key, payload


def _unmarshal(payload: memoryview) -> tuple[Any, ...] | None:
    """The entry's fields: (code, expanded, sites, warnings) now, the first three before."""
    try:
        fields = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return None
    return fields if isinstance(fields, tuple) and len(fields) >= 2 else None


def write(
    location: Location, entry_key: bytes, entry: Entry, *, cache_dir: Path | None = None
) -> None:
    """Write both files atomically: concurrent writers of one key write the same bytes.

    The folders are checked again (``trust``) once made: a link planted after the
    caller's check is refused here, with OSError, before anything is written.
    """
    from macrogen.files import write_atomic  # only the cold path needs tempfile

    _make_private(location.entry.parent)
    distrust = trust(location, cache_dir)
    if distrust is not None:
        raise OSError(distrust)
    if entry.expanded is not None:
        write_atomic(location.expanded, entry.expanded.encode("utf-8"), mode=0o644)
    else:
        location.expanded.unlink(missing_ok=True)  # left by a version that had sites
    payload = marshal.dumps((entry.code, entry.expanded, tuple(entry.sites), tuple(entry.warnings)))
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
            # made meanwhile (another rank; or a link planted since: never chmod through it)
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{directory} is not a folder of the cache") from None
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask


# -- `macrogen cache clear | info` -------------------------------------------------------
# A temp file of write_atomic for a cache file: .<cache name>.macrogen-<pid>-<random>.tmp
_TEMP = re.compile(r"^\.(.+\.macrogen-[^.]+\.(?:[^.]+\.mgc|py))\.macrogen-(\d+)-[^.]+\.tmp$")


def cache_files(trees: list[Path], cache_dirs: Sequence[Path] = ()) -> Iterator[Path]:
    """The files the cache wrote: entries, their expanded code and temp files of killed writes.

    In a source tree only ``__pycache__`` folders are searched (the interpreter's own
    ``.pyc`` files stay); a cache directory (``MACROGEN_CACHE_DIR``) is searched whole.
    A name is not proof: an ``.mgc`` counts only if it is a whole entry (magic and
    checksum), an expanded ``.py`` only if an entry beside it holds exactly its text,
    so a user's own ``train.macrogen-cpu.py`` in a tree given as ``--cache-dir`` stays.
    """
    seen: set[Path] = set()
    for root, whole in [(t, False) for t in trees] + [(c, True) for c in cache_dirs]:
        if not root.is_dir():
            continue
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in (".git", ".venv", "node_modules")]
            if not whole and Path(folder).name != "__pycache__":
                continue
            for path in _written_here(Path(folder), names):
                if path not in seen:
                    seen.add(path)
                    yield path


def _written_here(folder: Path, names: list[str]) -> Iterator[Path]:
    """Which of ``names`` (the files of ``folder``) the cache wrote; see ``cache_files``."""
    expansions: dict[str, set[bytes]] = {}  # expanded .py name -> texts the entries hold
    for name in names:
        if MARKER in name and name.endswith(ENTRY_SUFFIX) and not name.startswith("."):
            parsed = _parse(folder / name)
            if isinstance(parsed, str):
                continue
            yield folder / name
            payload = _unmarshal(parsed[1])
            if payload is not None and isinstance(payload[1], str):
                py = name[: -len(ENTRY_SUFFIX)].rsplit(".", 1)[0] + ".py"  # drop the tag
                expansions.setdefault(py, set()).add(payload[1].encode("utf-8"))
    for name in names:
        if name in expansions and _contents(folder / name) in expansions[name]:
            yield folder / name
        match = _TEMP.match(name)
        if match is not None and not _alive(int(match.group(2))):
            yield folder / name  # a killed write's; a live one's stays (it renames it soon)


def _contents(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def clear(trees: list[Path], cache_dirs: Sequence[Path] = ()) -> tuple[int, int]:
    """Remove the files the cache wrote (see ``cache_files``); returns (files, bytes) removed."""
    count = size = 0
    for path in list(cache_files(trees, cache_dirs)):
        try:
            n = os.lstat(path).st_size
            path.unlink()
        except FileNotFoundError:
            continue
        count += 1
        size += n
    return count, size
