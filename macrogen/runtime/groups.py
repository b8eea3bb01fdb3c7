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

``MACROGEN_BACKEND`` overrides the backend (a backend torch knows, such as
``gloo``, or ``device:backend`` pairs such as ``cpu:gloo,cuda:nccl``);
``MACROGEN_TIMEOUT`` (seconds) bounds every collective and barrier, and the whole
start-up under torchrun: reaching the store, then every rank's check that all
ranks were started with the same ``WORLD_SIZE`` and backend (``StartupError``
naming the rank and the setting that differ).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime import environment, shutdown

BACKEND_ENV = "MACROGEN_BACKEND"  # e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"; unset: chosen here
TIMEOUT_ENV = "MACROGEN_TIMEOUT"  # seconds a rank waits for the others; unset: torch's default
GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"
MAX_WORLD_SIZE = 2**31 - 1  # torch's store and groups take a C int
MAX_TIMEOUT_S = 365 * 24 * 3600  # a year: "forever" for a job, and within what timedelta holds


class RankTimeoutError(RuntimeError):
    """A rank did not reach a collective within the timeout (stopped, hung or too slow)."""


class StartupError(RuntimeError):
    """The ranks could not start together: they disagree on a setting, or one never came."""


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
    if requested is not None:
        check_backend(requested)
    if not 0 <= local_rank < max(local_world_size, 1):
        raise ValueError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
        )
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


def check_backend(text: str) -> None:
    """ValueError naming ``MACROGEN_BACKEND`` unless ``text`` is a backend torch knows.

    (torch itself fails on a typo with a bare "AssertionError: Unknown backend type".)
    """
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    for part in text.split(","):
        device, sep, name = part.strip().rpartition(":")
        if name.lower() not in known or (sep and not device.isidentifier()):
            raise ValueError(
                f"{BACKEND_ENV}={text!r}: {part.strip()!r} is not a backend; expected one of"
                f" {', '.join(known)}, or device:backend pairs such as {GLOO_AND_NCCL!r}"
                " (unset, or 'auto', lets macrogen choose)"
            )


def placement() -> Placement:
    """``choose_placement`` for this process, from torchrun's environment and this machine."""
    local_rank = environment.whole("LOCAL_RANK", 0, low=0)
    # Without LOCAL_WORLD_SIZE (another launcher), the world size: the same on every rank,
    # so every rank still picks the same backend.
    world = environment.whole("WORLD_SIZE", 1, low=1, high=MAX_WORLD_SIZE)
    local_world = environment.whole("LOCAL_WORLD_SIZE", None, low=1, high=MAX_WORLD_SIZE)
    if local_world is None:
        local_world = world
    elif local_world > world and environment.is_set("WORLD_SIZE"):
        # torchrun's invariant: "every rank is local" (the store's loopback binding) and the
        # backend are chosen from it
        raise environment.EnvironmentValueError(
            f"LOCAL_WORLD_SIZE={local_world} is above WORLD_SIZE={world}: the ranks on this"
            " machine are some of the job's"
        )
    cuda = torch.cuda.is_available()
    return choose_placement(
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        local_rank=local_rank,
        local_world_size=local_world,
        requested=environment.text(BACKEND_ENV),
    )


def timeout() -> datetime.timedelta | None:
    """``MACROGEN_TIMEOUT`` as a timedelta; None (torch's default, 10-30 minutes) when unset.
    At least a second (a smaller one fails every collective), at most a year."""
    seconds = environment.seconds(TIMEOUT_ENV, low=1.0, high=MAX_TIMEOUT_S)
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def launched_by_torchrun() -> bool:
    return all(environment.is_set(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


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


def init(where: Placement, **kwargs: Any) -> None:
    """Make ``where``'s GPU current (so NCCL and DeviceMesh find it), then the default group."""
    if where.cuda_ordinal is not None:
        torch.cuda.set_device(where.cuda_ordinal)
    if "store" not in kwargs and launched_by_torchrun():
        kwargs.update(_attempt_store(where))
    dist.init_process_group(backend=where.backend, timeout=timeout(), **kwargs)
    shutdown.at_exit()  # the group macrogen made, macrogen destroys at exit (see shutdown.py)


def _attempt_store(where: Placement) -> dict[str, Any]:
    """torchrun's store, with this attempt's keys under a prefix of their own; ranks checked.

    torchrun keeps one store for the whole job, and a worker group it restarted
    (``--max-restarts``) would read the previous attempt's addresses from it
    (gloo: "connectFullMesh failed ... Connection refused").

    The store is made as torch's ``env://`` makes it, but without rank 0 waiting for
    WORLD_SIZE clients: with ranks started with different WORLD_SIZEs that wait, then
    the connect, each took the whole timeout and named neither the rank nor the
    setting. Here reaching the store and ``_agree`` share one deadline.
    """
    limit = timeout()
    seconds = (limit or dist.constants.default_pg_timeout).total_seconds()
    deadline = time.monotonic() + seconds
    try:
        rank = environment.whole("RANK", None, low=0)
        world_size = environment.whole("WORLD_SIZE", None, low=1, high=MAX_WORLD_SIZE)
        port = environment.whole("MASTER_PORT", None, low=1, high=65535)
        attempt = environment.whole("TORCHELASTIC_RESTART_COUNT", 0, low=0)
    except environment.EnvironmentValueError as e:
        raise StartupError(str(e)) from None
    if rank is None or world_size is None or port is None:
        raise StartupError("RANK, WORLD_SIZE and MASTER_PORT must all be set (torchrun sets them)")
    if not rank < world_size:
        raise StartupError(f"RANK={rank} is not below WORLD_SIZE={world_size}")
    host = environment.text("MASTER_ADDR") or ""
    _resolve(host, port)
    agent = environment.text("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun's own store
    within = _within(limit)
    hosting = rank == 0 and not agent
    try:
        if not hosting:
            _wait_for_listener(host, port, deadline)
        tcp = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=hosting,
            timeout=datetime.timedelta(seconds=seconds),
            wait_for_workers=False,
            multi_tenant=not agent,
            master_listen_fd=_listener_on(host, port, world_size) if hosting else None,
        )
    except (RuntimeError, OSError) as e:
        raise StartupError(
            f"rank {rank}: can't reach the store at MASTER_ADDR={host} MASTER_PORT={port}"
            f" within {within}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    store = dist.PrefixStore(f"macrogen/attempt_{attempt}", tcp)
    _agree(store, rank, {"WORLD_SIZE": str(world_size), "backend": where.backend}, deadline, within)
    return {"store": store, "rank": rank, "world_size": world_size}


def _listener_on(host: str, port: int, world_size: int) -> int | None:
    """A socket bound to MASTER_ADDR's own address, for the store to listen on (torch's store
    binds every interface: a local job's store would be reachable from the network). None,
    and torch binds as it does, where that address may not be the one the others use: it is
    no address of this machine (behind a NAT), or a host name that resolves to loopback here
    (Debian's /etc/hosts) in a job that may span machines."""
    import ipaddress
    import socket

    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    local = environment.whole("LOCAL_WORLD_SIZE", None, low=1) == world_size
    literal = host == "localhost" or _is_address(host)
    if ipaddress.ip_address(address[0]).is_loopback and not (local or literal):
        return None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    return listener.detach()  # the store owns it now


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Until the store accepts connections; TimeoutError at ``deadline``.

    (TCPStore's client retries on its own, but a try that times out is followed by
    a back-off and another full try: about twice the timeout, and C++ logs.)
    """
    import socket

    while True:
        try:
            left = max(deadline - time.monotonic(), 0.05)
            socket.create_connection((host, port), timeout=left).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepted a connection ({e.strerror or e})") from None
            time.sleep(0.05)


def _resolve(host: str, port: int) -> None:
    """StartupError at once when MASTER_ADDR names no host: a failed name lookup does not
    heal by waiting (torch would retry it until its timeout, 30 minutes by default)."""
    import socket

    if not host:
        raise StartupError("MASTER_ADDR is blank: set it to the host name or address of rank 0")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise StartupError(
            f"MASTER_ADDR={host!r}: the name does not resolve to an address ({why});"
            " set it to the host name or IP address of rank 0's machine"
        ) from None


def _within(limit: datetime.timedelta | None) -> str:
    return f"{limit.total_seconds():g} s ({TIMEOUT_ENV})" if limit else "torch's default timeout"


def _agree(
    store: dist.Store, rank: int, mine: dict[str, str], deadline: float, within: str
) -> None:
    """Every rank posts its settings; rank 0 compares them all and posts the verdict.

    A rank that differs from rank 0 says so itself; the others learn it from the
    verdict. Nobody waits past ``deadline``. Keys live under this attempt's prefix.
    """
    if store.add(f"startup/count_{rank}", 1) > 1:
        raise StartupError(f"RANK={rank} was given to two processes: each rank needs its own RANK")
    store.set(f"startup/rank_{rank}", json.dumps(mine))
    world_size = int(mine["WORLD_SIZE"])

    def differ(other: int, theirs: dict[str, str]) -> str | None:
        for name, value in mine.items():
            if theirs.get(name) != value:
                first, second = sorted([(rank, value), (other, theirs.get(name))])
                return (
                    f"ranks were started with different {name}: rank {first[0]} has {name}="
                    f"{first[1]}, rank {second[0]} has {name}={second[1]}"
                    " (every rank needs the same; check the launcher's environment)"
                )
        return None

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    def done() -> None:  # rank 0 hosts the store: it stays until the others have read from it
        with contextlib.suppress(RuntimeError, OSError):
            store.set(f"startup/done_{rank}", "1")

    if rank != 0:
        try:
            store.wait(["startup/rank_0"], left())
            problem = differ(0, json.loads(store.get("startup/rank_0")))
            if problem is not None:
                done()
                raise StartupError(f"rank {rank}: {problem}")
            store.wait(["startup/verdict"], left())
        except (RuntimeError, OSError) as e:
            if isinstance(e, StartupError):
                raise
            raise StartupError(
                f"rank {rank}: rank 0 did not confirm that all {world_size} ranks started"
                f" within {within}; a rank did not start, or was started with other settings"
            ) from None
        verdict = store.get("startup/verdict").decode()
        done()
        if verdict != "ok":
            raise StartupError(f"rank {rank}: {verdict}")
        return

    def refuse(problem: str) -> StartupError:
        """Post the verdict, and give the ranks that started a moment to read it before this
        process (the store's host) exits."""
        store.set("startup/verdict", problem)
        started = [r for r in range(1, world_size) if store.check([f"startup/rank_{r}"])]
        until = min(deadline, time.monotonic() + 5.0)
        while started and time.monotonic() < until:
            started = [r for r in started if not store.check([f"startup/done_{r}"])]
            time.sleep(0.02)
        return StartupError(f"rank 0: {problem}")

    pending = list(range(1, world_size))
    while pending:
        for other in list(pending):
            if store.check([f"startup/rank_{other}"]):
                pending.remove(other)
                problem = differ(other, json.loads(store.get(f"startup/rank_{other}")))
                if problem is not None:
                    raise refuse(problem)
        if pending and time.monotonic() > deadline:
            missing = ", ".join(map(str, pending[:8])) + (" ..." if len(pending) > 8 else "")
            problem = (
                f"rank{'s' * (len(pending) > 1)} {missing} of WORLD_SIZE={world_size} did not"
                f" start within {within} (or started with another MASTER_ADDR/MASTER_PORT)"
            )
            raise refuse(problem)
        if pending:
            time.sleep(0.02)
    store.set("startup/verdict", "ok")


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
        seconds = (
            f"{limit.total_seconds():g} s ({TIMEOUT_ENV})" if limit else "torch's default timeout"
        )
        raise RankTimeoutError(
            f"{where}: not every rank arrived within {seconds}; a rank is stopped, hung or"
            f" slower than that (raised on rank {dist.get_rank()}). torch says: {e}"
        ) from e
