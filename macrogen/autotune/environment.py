"""The machine a measurement was taken on: the device for the tuning key, versions for the record."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any


def device(target: str) -> dict[str, str]:
    """``{"kind": "cpu"|"cuda", "name": ...}``; raises RuntimeError for a CUDA target without a GPU."""
    if target == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--target cuda needs a CUDA device, and this machine has none")
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0)}
    return {"kind": "cpu", "name": cpu_name()}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def versions() -> dict[str, Any]:
    """Recorded with each record, not part of its key: what a reader needs to judge it."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    for package in ("torch", "triton"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def entry_origin(entry_module: str, search_path: list[str]) -> Path | None:
    """The file the entry module would be imported from (found, not imported)."""
    saved = list(sys.path)
    sys.path[:0] = [p for p in search_path if p not in sys.path]
    try:
        spec = importlib.util.find_spec(entry_module)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return Path(spec.origin).resolve()


def file_hash(path: Path | None) -> str:
    """The hash of the entry module's file: what it builds and feeds is part of what is measured."""
    if path is None:
        return "missing"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
