"""Process groups: the program's own, or one made from torchrun's environment.

Expanded code never asks users to change their launcher: under torchrun the
default group is initialized here (NCCL on CUDA, gloo on CPU) if the program did
not do it itself; run without torchrun, everything is world size 1.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_data_parallel_group: dist.ProcessGroup | None = None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def ensure_initialized() -> bool:
    """Initialize the default group from torchrun's environment if needed; False if serial."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if not launched_by_torchrun():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    return True


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if ensure_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if ensure_initialized() else 0


def set_data_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Set by a data x tensor mesh so data-parallel buckets reduce over the data group only."""
    global _data_parallel_group
    _data_parallel_group = group


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group data-parallel modules reduce over (None: the default group)."""
    return _data_parallel_group
