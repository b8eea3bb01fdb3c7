"""Reading sources and writing outputs without ever losing a user's file.

Outputs are written in two steps: every file is first *staged* (written whole to
a temporary file beside its target, flushed to disk), and only when all of them
are staged are they renamed into place. If anything fails before that, the
staged files are removed and no output has changed. Temporary files are named
``.<name>.macrogen-<pid>-<random>.tmp``: one whose process is gone (killed
mid-run) is removed by the next run that writes to the same folder.

What is written through instead of renamed over: a character device
(``-o /dev/null``), a FIFO (when something reads it) and the target of a
symlink. Block devices, sockets and directories are refused. A file without
any write permission bit is refused too: ``--in-place`` does not rewrite a
read-only file (make it writable first).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import stat
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

TMP_SUFFIX = ".tmp"
_TMP_NAME = re.compile(r"^\..+\.macrogen-(\d+)-[^.]+\.tmp$")


class WriteError(OSError):
    """An output that can't be written; ``str()`` names it and says why."""


_PROBE = "# -*- coding: x -*-\nimport macrogen as mg  # (1) [2] {3} 'a' \"b\" \\ \t\r\n"


def read_source(data: bytes) -> tuple[str, str]:
    """Decode a Python file as Python does (coding cookie, BOM); returns (text, encoding).

    Raises SyntaxError for an unknown or non-text encoding (``coding: rot13``), as
    Python does, and UnicodeDecodeError for bytes the encoding can't decode.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    try:
        if encoding != "utf-8-sig" and _PROBE.encode(encoding) != _PROBE.encode("ascii"):
            # As Python: a source encoding must read ASCII as ASCII (not utf-16, not punycode)
            raise SyntaxError(f"encoding problem: {encoding}")
        text = data.decode(encoding)
    except UnicodeDecodeError:
        raise
    except LookupError:  # a codec that is not a text encoding: rot13, base64, ...
        raise SyntaxError(f"encoding problem: {encoding} is not a text encoding") from None
    except (UnicodeError, ValueError, TypeError) as e:  # a codec that fails its own way (idna)
        raise SyntaxError(f"encoding problem: {encoding}: {e}") from None
    if encoding == "utf-8-sig" and text.startswith("\ufeff"):
        text = text[1:]
    return text, encoding


def encode_source(text: str, encoding: str) -> bytes:
    """The expansion in the source's own encoding.

    The user's text decoded from it, so it encodes; only generated code (a
    ``define``d string written back, a path in a comment) can hold a character
    the encoding lacks, and there a backslash escape means the same: in a string
    literal ``\\u4e2d`` is the character, in a comment it names it.
    """
    try:
        return text.encode(encoding, errors="backslashreplace")
    except (UnicodeError, LookupError, ValueError, TypeError) as e:  # codecs without the handler
        raise UnicodeError(
            f"can't write the expansion in the file's encoding {encoding}: {e}"
        ) from None


# -- staging and committing -------------------------------------------------------------
@dataclass
class Staged:
    """One output on its way: ``tmp`` is renamed to ``target``, or ``data`` written through."""

    target: Path  # the real file (a symlink resolved)
    tmp: Path | None  # None: written through at commit (a device, a FIFO)
    data: bytes


def target_of(path: Path) -> Path:
    """Where writing ``path`` lands: the file itself, or the end of its chain of symlinks."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable(path: Path) -> None:
    """Raise WriteError if ``path`` (after symlinks) is something macrogen won't write."""
    target = target_of(path)
    try:
        st = target.stat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise WriteError(f"can't write {path}: {e.strerror or e}") from None
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise WriteError(f"can't write {path}: it is a directory")
    if stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise WriteError(f"can't write {path}: not a regular file, a character device or a FIFO")
    if stat.S_ISREG(mode) and not mode & 0o222:
        raise WriteError(
            f"{path} is read-only: macrogen does not rewrite read-only files"
            " (make it writable first: chmod u+w)"
        )


def stage(path: Path, data: bytes, *, mode: int | None = None) -> Staged:
    """Write ``data`` beside ``path`` (after symlinks) in a temporary file, flushed to disk.

    Callers remove the stale temporary files of killed runs first (``clean_stale``), once
    per folder.

    The file gets ``mode``, else the mode of the file it replaces, else 0644.
    """
    check_writable(path)
    target = target_of(path)
    if target.exists() and not target.is_file():
        return Staged(target, None, data)  # a character device or a FIFO: written through
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.macrogen-{os.getpid()}-", suffix=TMP_SUFFIX
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
        os.chmod(tmp, mode)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Staged(target, Path(tmp), data)


def commit(staged: Staged) -> None:
    """Put one staged output in place: a rename, or a write through to a device or FIFO."""
    if staged.tmp is not None:
        os.replace(staged.tmp, staged.target)
        return
    _write_through(staged.target, staged.data)


def discard(staged: list[Staged]) -> None:
    for s in staged:
        if s.tmp is not None:
            s.tmp.unlink(missing_ok=True)


def _write_through(path: Path, data: bytes) -> None:
    try:  # non-blocking open: a FIFO nobody reads is an error, not a hang
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise WriteError(f"can't write {path}: nothing is reading this FIFO") from None
        raise
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Write one file: readers see the old contents or the new, never half."""
    clean_stale(target_of(path).parent)
    commit(stage(path, data, mode=mode))


def clean_stale(folder: Path) -> int:
    """Remove our temporary files in ``folder`` whose writing process is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        match = _TMP_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(folder / name)
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or not a pid we can ask about: leave it
    return True
