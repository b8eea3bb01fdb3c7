"""Process groups: the program's own, or one made from torchrun's environment.

Expanded code never asks users to change their launcher: under torchrun the
default group is initialized here if the program did not do it itself; run
without torchrun, everything is world size 1.

Which backend, and which device each rank uses, is decided by one pure
function, ``choose_placement`` (tests call it directly with made-up machines):

- no GPU: ``gloo``, on the CPU;
- at least one GPU per rank on this node (LOCAL_WORLD_SIZE <= GPUs):
  ``cpu:gloo,cuda:nccl``, so collectives on CUDA tensors take NCCL and those on
  CPU tensors (metrics, the rank-agreement check) take gloo; rank r uses
  ``cuda:LOCAL_RANK``;
- more ranks on this node than GPUs: NCCL cannot run two ranks on one GPU,
  so ``gloo`` carries CPU and CUDA tensors alike (correct, not fast), and the
  ranks share the GPUs (``cuda:LOCAL_RANK % GPUs``). Asking for NCCL
  explicitly (``MACROGEN_BACKEND=nccl``) on such a node is an error instead.

``MACROGEN_BACKEND`` overrides the backend (any string ``init_process_group``
takes); ``MACROGEN_TIMEOUT`` (seconds) bounds every collective and barrier.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKEND_ENV = "MACROGEN_BACKEND"  # e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"; unset: chosen here
TIMEOUT_ENV = "MACROGEN_TIMEOUT"  # seconds a rank waits for the others; unset: torch's default
GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"


class RankTimeoutError(RuntimeError):
    """A rank did not reach a collective within the timeout (stopped, hung or too slow)."""


@dataclass(frozen=True)
class Placement:
    """Where this rank runs and how ranks talk (see the module docstring)."""

    backend: str  # passed to init_process_group
    device: str  # this rank's device: "cpu" or "cuda:N"
    cuda_ordinal: int | None  # the GPU to make current before init (None: no GPU)
    note: str = ""  # why, when it is not one GPU per rank (examples/run.py prints it)


def choose_placement(
    *,
    cuda_available: bool,
    device_count: int,
    local_rank: int,
    local_world_size: int,
    requested: str | None = None,
) -> Placement:
    """The backend and device of rank ``local_rank`` of ``local_world_size`` on this node.

    Pure: the same inputs give the same answer on every rank of a node, so all
    ranks pick the same backend. Never names a GPU ordinal that does not exist.
    """
    requested = (requested or "").strip() or None
    if requested == "auto":
        requested = None
    if not 0 <= local_rank < max(local_world_size, 1):
        raise ValueError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}")
    if not cuda_available or device_count < 1:
        if requested is not None and "nccl" in requested:
            raise ValueError(
                f"{BACKEND_ENV}={requested!r} asks for NCCL, but this machine has no usable GPU:"
                f" unset it (gloo is used on CPUs)"
            )
        return Placement(requested or "gloo", "cpu", None)
    ordinal = local_rank % device_count  # always an ordinal that exists
    device = f"cuda:{ordinal}"
    if local_world_size <= device_count:  # one GPU (or more) per rank
        return Placement(requested or GLOO_AND_NCCL, device, ordinal)
    shared = (
        f"{local_world_size} ranks on this node share {device_count} GPU"
        f"{'s' if device_count > 1 else ''}"
    )
    if requested is not None and "nccl" in requested:
        raise ValueError(
            f"{BACKEND_ENV}={requested!r}: NCCL needs one GPU per rank, but {shared}."
            f" Launch at most {device_count} process{'es' if device_count > 1 else ''} per node"
            f" (torchrun --nproc-per-node {device_count}), or unset {BACKEND_ENV} to use gloo"
        )
    return Placement(
        requested or "gloo",
        device,
        ordinal,
        note=f"{shared}: NCCL needs one GPU per rank, so gloo carries CPU and CUDA tensors"
        " (correct, not fast)",
    )


def placement() -> Placement:
    """``choose_placement`` for this process, from torchrun's environment and this machine."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Without LOCAL_WORLD_SIZE (another launcher), the world size: the same on every rank,
    # so every rank still picks the same backend.
    local_world = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    cuda = torch.cuda.is_available()
    return choose_placement(
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        local_rank=local_rank,
        local_world_size=int(local_world),
        requested=os.environ.get(BACKEND_ENV),
    )


def timeout() -> datetime.timedelta | None:
    """``MACROGEN_TIMEOUT`` as a timedelta; None (torch's default, 10-30 minutes) when unset."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


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
    init(placement())
    return True


def init(where: Placement, **kwargs) -> None:
    """Make ``where``'s GPU current (so NCCL and DeviceMesh find it), then the default group."""
    if where.cuda_ordinal is not None:
        torch.cuda.set_device(where.cuda_ordinal)
    if "store" not in kwargs and launched_by_torchrun():
        kwargs.update(_attempt_store())
    dist.init_process_group(backend=where.backend, timeout=timeout(), **kwargs)


def _attempt_store() -> dict:
    """torchrun's store, with this attempt's keys under a prefix of their own.

    torchrun keeps one store for the whole job, and a worker group it restarted
    (``--max-restarts``) would read the previous attempt's addresses from it
    (gloo: "connectFullMesh failed ... Connection refused").
    """
    limit = timeout()
    found = dist.rendezvous("env://") if limit is None else dist.rendezvous("env://", timeout=limit)
    store, rank, world_size = next(found)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"macrogen/attempt_{attempt}", store)
    return {"store": store, "rank": rank, "world_size": world_size}


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if ensure_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if ensure_initialized() else 0


def barrier(where: str, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` is here; a rank missing after the timeout is named.

    A monitored barrier (gloo: every backend string with gloo in it) before a
    start-up collective turns a stopped or hung peer into a clear error on the
    other ranks, rather than a wait of torch's default 30 minutes.
    """
    if "gloo" not in str(dist.get_backend(group)):
        return  # NCCL alone has no monitored barrier; its watchdog applies the group's timeout
    limit = timeout()
    try:
        dist.monitored_barrier(group=group, timeout=limit, wait_all_ranks=True)
    except RuntimeError as e:
        seconds = f"{limit.total_seconds():g} s ({TIMEOUT_ENV})" if limit else "torch's default timeout"
        raise RankTimeoutError(
            f"{where}: not every rank arrived within {seconds}; a rank is stopped, hung or"
            f" slower than that (raised on rank {dist.get_rank()}). torch says: {e}"
        ) from e


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group data-parallel modules reduce over: the mesh's data dimension.

    None is the default group (no tensor parallelism, or serial). Read from the
    program's one mesh (``runtime.mesh``), which is made here if no
    tensor-parallel module made it first.
    """
    from macrogen.runtime import mesh  # mesh builds on this module

    return mesh.mesh().data_group
