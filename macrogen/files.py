"""Reading sources and writing outputs without ever losing a user's file."""

from __future__ import annotations

import io
import os
import tempfile
import tokenize
from pathlib import Path


def read_source(data: bytes) -> tuple[str, str]:
    """Decode a Python file as Python does (coding cookie, BOM); returns (text, encoding)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
    if encoding == "utf-8-sig" and text.startswith("\ufeff"):
        text = text[1:]
    return text, encoding


def encode_source(text: str, encoding: str) -> bytes:
    return text.encode(encoding)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
