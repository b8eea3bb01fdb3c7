"""The machine a measurement was taken on: the device for the tuning key, versions for the record."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any


def device(target: str) -> dict[str, Any]:
    """The device kind of this machine's first device (``device_kinds``' first)."""
    return device_kinds(target)[0][0]


def device_kinds(target: str) -> list[tuple[dict[str, Any], list[int]]]:
    """Each kind of device this machine has, with the indices of its devices (CUDA), as the
    tuning key names it: ``{"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability":
    "9.0", "memory": 79, "link": "nvlink x18"}`` (memory in GiB, link: active NVLinks, else
    PCIe, when NVML can tell); a CPU machine is one kind. A mixed machine (an H100 and an
    A100) is tuned once per kind, each on its own devices. RuntimeError for a CUDA target
    without a GPU."""
    if target != "cuda":
        memory = 0
        with contextlib.suppress(ValueError, OSError, AttributeError):
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
        kind = {
            "kind": "cpu",
            "name": cpu_name(),
            "capability": platform.machine() or "unknown",
            "memory": memory,
            "link": "loopback",  # gloo ranks on one host
        }
        return [(kind, [])]
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--target cuda needs a CUDA device, and this machine has none")
    found: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for index in range(torch.cuda.device_count()):
        kind = cuda_kind(index)
        found.setdefault(repr(sorted(kind.items())), (kind, []))[1].append(index)
    return list(found.values())


def cuda_kind(index: int) -> dict[str, Any]:
    """The device kind of CUDA device ``index``, as the tuning key names it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return {
        "kind": "cuda",
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory": props.total_memory // 2**30,
        "link": _link(index),
    }


def rank_device(target: str | None) -> dict[str, Any]:
    """This rank's device kind: the GPU its ``LOCAL_RANK`` runs on (``groups.placement``, the
    choice the program's own start-up makes), else the CPU; the CPU too for a ``cpu`` target.
    A rank of a mixed job (H100 and A100 nodes) names its own kind, so it can look up its own
    kind's tuning winners (``database.winners(..., device=)``)."""
    if target != "cpu":
        from macrogen.runtime import groups

        ordinal = groups.placement().cuda_ordinal
        if ordinal is not None:
            return cuda_kind(ordinal)
    return device_kinds("cpu")[0][0]


def _link(index: int) -> str:
    """How GPU ``index`` reaches its peers: its active NVLinks (NVML), else PCIe; "unknown"
    without NVML."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return "unknown"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        active = 0
        for link in range(18):  # NVML_NVLINK_MAX_LINKS on Hopper
            with contextlib.suppress(pynvml.NVMLError):
                active += bool(pynvml.nvmlDeviceGetNvLinkState(handle, link))
        return f"nvlink x{active}" if active else "pcie"
    except Exception:  # NVML present but unusable (no driver access): say so, don't fail
        return "unknown"


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
