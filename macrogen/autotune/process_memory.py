"""A process's memory, measured the same way by the probe and by each measured layout.

Memory on CPU is the process's resident set (``/proc/self/status``): torch has
no CPU allocator statistics. ``VmHWM``, the peak, is reset through
``/proc/self/clear_refs`` before what is measured; before that, a small model
runs a few steps (``warm_process``: the one-time buffers of torch's first
backward and optimizer step are not the model's), and ``malloc_trim`` hands
the memory freed by an earlier candidate back to the system (glibc keeps it
otherwise, and the next candidate's peak would hide in it). Fixing
``MALLOC_MMAP_THRESHOLD_`` instead made every step 7x slower. On CUDA it is
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations


def _status(field: str) -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss() -> int:
    """Resident bytes now (0 where /proc is missing)."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    return _status("VmRSS")


def warm_process(distributed: bool = False) -> None:
    """A few steps of a small model: torch's one-time buffers are made before any baseline."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(64, 64)).square().mean().backward()
        opt.step()
    # what mg.parallelize's layouts import on first use, so that no layout pays for it
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.utils.benchmark  # noqa: F401  (one process's timer)

    import macrogen.runtime.data_parallel  # noqa: F401
    import macrogen.runtime.fully_sharded  # noqa: F401
    import macrogen.runtime.parallelize  # noqa: F401

    if distributed:
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1024))
        dist.barrier()


def trim() -> None:
    """Give freed memory back to the system (glibc), so that RSS falls to what is live."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def peak() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return _status("VmHWM")
