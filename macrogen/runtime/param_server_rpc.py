"""The parameter server over ``torch.distributed.rpc``, only where a program asks for it:
``ServerConfig(transport="rpc")`` or ``MACROGEN_SERVER_TRANSPORT=rpc``.

Trust (docs/async.md, "Trust"): torch RPC unpickles what reaches its ports, so whoever can
connect to them runs code in the job, and malformed bytes can abort a rank. Run it only on a
private network. What this module does to narrow that: TensorPipe's TCP transport alone
(no shared-memory listener), bound to the interface the job uses (loopback when every rank
is on this machine, else the one that reaches MASTER_ADDR), never to every interface; and
the RPC rendezvous on the job's own store (no listener of its own).

The default transport (``param_server_wire``) sends tensors over the job's process group
instead and unpickles nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading
import urllib.parse
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime import environment
from macrogen.runtime.param_server_table import ServerConfig, ServerTable

_WORKER = "mg_ps_worker{}"
_SERVER = "mg_ps_server{}"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address

# On a server: its tables by index, each with the condition a waiting fetch waits on. (RPC
# calls module-level functions by name in the server's process: they find the tables here.)
_TABLES: dict[int, tuple[ServerTable, threading.Condition]] = {}


def _table(index: int) -> tuple[ServerTable, threading.Condition]:
    return _TABLES[index]


def _fetch(index: int, worker: int, step: int, ids: torch.Tensor, training: bool) -> torch.Tensor:
    table, cond = _table(index)
    with cond:
        if not cond.wait_for(lambda: table.ready(step), table.config.timeout_s):
            raise TimeoutError(
                f"parameter server: worker {worker}'s step {step} waited"
                f" {table.config.timeout_s:g} s for the other workers' pushes"
                f" (applied per worker: {table.applied})"
            )
        if table.check_ids(ids.long()) is not None:
            raise ValueError(f"parameter server: worker {worker} asked for rows outside the table")
        return table.read(worker, step, ids, training)


def _push(index: int, worker: int, step: int, grads: torch.Tensor) -> None:
    table, cond = _table(index)
    with cond:
        table.push(worker, step, grads)
        cond.notify_all()


def _lag(index: int) -> int:
    return _table(index)[0].max_lag


def _export(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    table, cond = _table(index)
    with cond:
        if not cond.wait_for(lambda: table.settled(step), table.config.timeout_s):
            raise TimeoutError(f"parameter server: step {step}'s pushes never all came")
        return table.export()


def _load(index: int, rows: torch.Tensor, sums: torch.Tensor | None, step: int) -> None:
    table, cond = _table(index)
    with cond:
        table.load(rows, sums, step)
        cond.notify_all()


class RpcWire:
    """A worker's requests over RPC: the same calls as ``param_server_wire.Wire``."""

    def __init__(self, worker: int, servers: int):
        self.worker = worker
        self.servers = servers
        self.futures: list[Any] = []
        self.closed = False

    def fetch(
        self, table: int, step: int, ids: list[torch.Tensor], training: bool
    ) -> list[torch.Tensor]:
        from torch.distributed import rpc

        self.settle()
        futures = [
            rpc.rpc_async(
                _SERVER.format(j), _fetch, args=(table, self.worker, step, part, training)
            )
            for j, part in enumerate(ids)
        ]
        return [f.wait() for f in futures]

    def push(self, table: int, step: int, grads: list[torch.Tensor]) -> None:
        from torch.distributed import rpc

        for j, g in enumerate(grads):
            args = (table, self.worker, step, g)
            self.futures.append(rpc.rpc_async(_SERVER.format(j), _push, args=args))

    def lag(self, table: int) -> list[int]:
        from torch.distributed import rpc

        return [rpc.rpc_sync(_SERVER.format(j), _lag, args=(table,)) for j in range(self.servers)]

    def export(self, table: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        from torch.distributed import rpc

        self.settle()
        return [
            rpc.rpc_sync(_SERVER.format(j), _export, args=(table, step))
            for j in range(self.servers)
        ]

    def load(
        self, table: int, step: int, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        from torch.distributed import rpc

        self.settle()
        for j, (rows, sums) in enumerate(parts):
            rpc.rpc_sync(_SERVER.format(j), _load, args=(table, rows, sums, step))

    def settle(self) -> None:
        futures, self.futures = self.futures, []
        for f in futures:
            f.wait()

    def close(self) -> None:
        """Stop this worker's RPC agent (after its last push): the servers exit once every
        worker has."""
        from torch.distributed import rpc

        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            rpc.shutdown()


def start(
    rank: int, world: int, workers: int, tables: list[ServerTable] | None, config: ServerConfig
) -> None:
    """Start this rank's RPC agent (``tables``: this rank is a server and holds them)."""
    from torch.distributed import rpc

    if tables is not None:
        for i, table in enumerate(tables):
            _TABLES[i] = (table, threading.Condition())
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=_rendezvous(),
        rpc_timeout=config.timeout_s + 30,
        num_worker_threads=max(16, 4 * workers * max(len(tables or ()), 1)),
        _transports=["uv"],  # TCP only: no shared-memory listener
        _channels=["basic"],  # tensors travel on that one connection (no multiplexed lanes)
    )
    name = _SERVER.format(rank - workers) if tables is not None else _WORKER.format(rank)
    with _listening_on(_interface()):
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)


def serve() -> None:
    """A server: answer until every worker has shut its agent down."""
    from torch.distributed import rpc

    rpc.shutdown()
    _TABLES.clear()


# -- where it listens, and its rendezvous ----------------------------------------------------


def _interface() -> str:
    """The interface TensorPipe listens on: loopback when every rank runs on this machine
    (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE, or MASTER_ADDR is a loopback address), else
    the one through which this machine reaches MASTER_ADDR."""
    master = environment.text("MASTER_ADDR") or "127.0.0.1"
    world = environment.whole("WORLD_SIZE", 1, low=1)
    local = environment.whole("LOCAL_WORLD_SIZE", None, low=1)
    address = socket.gethostbyname(master)
    if local == world or ipaddress.ip_address(address).is_loopback:
        address = "127.0.0.1"
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # (UDP: nothing is sent; the route picks the address)
            address = probe.getsockname()[0]
    for _, name in socket.if_nameindex():
        if _address_of(name) == address:
            return name
    raise RuntimeError(
        f"parameter server (rpc): no network interface holds {address}, the address this"
        " rank reaches MASTER_ADDR from; set TP_SOCKET_IFNAME to the job's interface"
    )


def _address_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError:  # no IPv4 address
            return None


@contextlib.contextmanager
def _listening_on(interface: str) -> Any:
    """TensorPipe reads TP_SOCKET_IFNAME when its agent starts (a user's own setting wins)."""
    key = "TP_SOCKET_IFNAME"
    saved = os.environ.get(key)
    if saved is None:
        os.environ[key] = interface
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)


_SCHEME = "macrogen-ps"


def _rendezvous() -> str:
    """An ``init_method`` whose store is a new client of the job's own store, under a prefix
    of this attempt's (torchrun's store outlives a restart): RPC opens no listener for it."""
    with contextlib.suppress(RuntimeError):  # registered by an earlier start in this process
        dist.register_rendezvous_handler(_SCHEME, _job_store)
    return f"{_SCHEME}://"


def _job_store(url: str, **_: Any) -> Any:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):  # a client of its own: RPC sets its timeout
        store = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False)
    attempt = environment.whole("TORCHELASTIC_RESTART_COUNT", 0, low=0)
    prefix = f"macrogen/param_server_rpc/attempt_{attempt}"
    yield dist.PrefixStore(prefix, store), int(query["rank"]), int(query["world_size"])
