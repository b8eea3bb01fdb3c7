"""The parameter server's wire: requests and replies as tensors over c10d point-to-point.

Every message is a tensor sent with ``isend`` and received with ``recv``/``irecv`` on a gloo
group of the whole job, so nothing read from the network is unpickled, and the only sockets
are the process group's own. A message's size and dtype are fixed by the header before it,
and a server checks each header (the operation, the table, a count within the table's
share) before it allocates anything, so a malformed request is a clear error, never an
allocation of what the bytes say.

    worker -> server   HEAD  header: int64 [op, table, step, n, flag]
                       DATA  the request's tensors, as the header says
    server -> worker   REPLY reply: int64 [status, a, b, c]
                       ROWS  the reply's tensors (after an OK reply only)

    FETCH (table, step, n, flag) + ids[n] -> rows[n, dim]   flag: WIDE (int64 ids, else
                                                            int32) | TRAINING (a push follows)
    PUSH  (table, step, n) + grads[n, dim]        no reply: an error comes with the next one
    LAG   (table)                                  -> a = the largest lag a fetch saw
    EXPORT(table, step)                            -> rows[share, dim] (+ Adagrad sums)
    LOAD  (table, step, has_sums) + rows[share, dim] (+ sums)  -> OK
    BYE                                            the worker is done

A server (``Server.serve``) has one thread per worker, blocked on that worker's next header
(a blocking receive from one peer ends with an error when that peer's process ends, which a
receive from any peer does not); it answers the request itself, under one lock over the
tables. A worker is known by the connection its bytes came on, never by what they say. A
fetch or export that must wait for other workers' pushes is kept until it may be answered,
or until the worker it waits for has said it is done (an error reply naming that worker).
A worker posts the receives of a reply before it asks, so no answer waits for them.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime.param_server_table import PushError, ServerTable

HEAD, DATA, REPLY, ROWS = 1, 2, 3, 4  # tags
FETCH, PUSH, LAG, EXPORT, LOAD, BYE = range(1, 7)
OK, LEFT, NO_FETCH, BAD_IDS = range(4)  # reply statuses
WIDE, TRAINING = 1, 2  # FETCH's flag bits
HEADER_FIELDS = 5
REPLY_FIELDS = 4


@dataclass(frozen=True)
class Shape:
    """What both ends know of one table on one server, so that sizes never travel alone."""

    share: int  # rows this server holds
    dim: int
    dtype: torch.dtype
    sums: bool  # the server keeps Adagrad sums (an export and a load carry them)


def share_of(rows: int, server: int, servers: int) -> int:
    """How many of rows 0..rows-1 live on ``server`` (rows r with r % servers == server)."""
    return (rows - server + servers - 1) // servers


# -- the server's end ------------------------------------------------------------------------


@dataclass
class _Request:
    worker: int  # 0..W-1
    op: int
    table: int
    step: int
    flag: int
    data: list[torch.Tensor] = field(default_factory=list)


class ProtocolError(RuntimeError):
    """A message that is not a request of this protocol (not from a macrogen worker)."""


class Server:
    """One server rank: its share of every table, answering the workers until all said BYE."""

    def __init__(self, tables: list[ServerTable], group: Any, worker_ranks: list[int]):
        self.tables = tables
        self.group = group
        self.worker_ranks = worker_ranks  # global ranks of workers 0..W-1
        self.lock = threading.Lock()  # the tables and the lists below: one reader at a time
        self.sending: list[tuple[Any, torch.Tensor]] = []  # isends in flight, kept alive
        self.waiting: list[_Request] = []  # fetches and exports that wait for pushes
        self.gone: set[int] = set()  # workers that said BYE
        self.failed: dict[int, tuple[int, int, int, int]] = {}  # worker -> its next reply
        self.ended: queue.Queue[tuple[int, str | None]] = queue.Queue()  # readers' ends

    def serve(self) -> None:
        """Answer until every worker said BYE; ProtocolError when a worker's connection ends
        without it, or carries what is no request."""
        readers = [
            threading.Thread(target=self._read, args=(w,), daemon=True, name=f"mg-ps-read-{w}")
            for w in range(len(self.worker_ranks))
        ]
        for reader in readers:
            reader.start()
        for _ in self.worker_ranks:
            worker, why = self.ended.get()
            if why is not None:
                raise ProtocolError(
                    f"parameter server: worker {worker} (rank {self.worker_ranks[worker]}): {why}"
                )
        # Every reader has returned from _read, but a thread still holds this server (its
        # target, a bound method) until it has ended: joined, so that no reader outlives
        # serve(). A reader left running would drop the last reference to the process group
        # (after destroy_process_group at exit) while the interpreter finalizes: the group's
        # destructor releases the GIL, the daemon thread is ended when it asks for it back,
        # and that unwinds a noexcept destructor: SIGABRT, "terminate called without an
        # active exception".
        for reader in readers:
            reader.join()
        with self.lock:
            sending, self.sending = self.sending, []
        for work, _ in sending:
            work.wait()

    # -- reading (one thread per worker) ----------------------------------------------------

    def _read(self, worker: int) -> None:
        """Worker ``worker``'s requests, answered in this thread (one reader per worker: a
        blocking receive from one peer ends with an error when that peer's process ends)."""
        src = self.worker_ranks[worker]
        header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        while True:
            try:
                dist.recv(header, src=src, group=self.group, tag=HEAD)
                request = self._parse(worker, header.tolist())
                for tensor in request.data:
                    dist.recv(tensor, src=src, group=self.group, tag=DATA)
            except (RuntimeError, ValueError) as e:
                text = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.ended.put((worker, f"stopped ({text})"))
                return
            with self.lock:
                self._handle(request)
                self._retry()
                self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
            if request.op == BYE:
                self.ended.put((worker, None))
                return

    def _parse(self, worker: int, header: list[int]) -> _Request:
        """The request a header announces, with empty tensors for its data; ValueError when
        it announces anything this protocol does not send."""
        op, table, step, n, flag = header
        request = _Request(worker, op, table, step, flag)
        if op == BYE:
            return request
        if op not in (FETCH, PUSH, LAG, EXPORT, LOAD) or not 0 <= table < len(self.tables):
            raise ValueError(f"not a request: header {header}")
        rows = self.tables[table].rows
        share, dim = rows.shape
        flags = {FETCH: WIDE | TRAINING, LOAD: 1}.get(op, 0)
        if not 0 <= step < 2**62 or flag & ~flags:
            raise ValueError(f"not a request: header {header}")
        if op in (FETCH, PUSH) and not 0 <= n <= share:
            raise ValueError(f"{n} rows asked of a share of {share}")
        if op == FETCH:
            request.data = [torch.empty(n, dtype=torch.int64 if flag & WIDE else torch.int32)]
        elif op == PUSH:
            request.data = [torch.empty(n, dim, dtype=rows.dtype)]
        elif op == LOAD:
            request.data = [torch.empty(share, dim, dtype=rows.dtype) for _ in range(1 + flag)]
        return request

    # -- answering (a reader, holding the lock) ---------------------------------------------

    def _handle(self, r: _Request) -> None:
        if r.op == BYE:
            self.gone.add(r.worker)
            return
        table = self.tables[r.table]
        if r.op == PUSH:
            try:
                table.push(r.worker, r.step, r.data[0])
            except PushError:
                self.failed[r.worker] = (NO_FETCH, r.step, 0, 0)  # told at its next request
            return
        failed = self.failed.pop(r.worker, None)
        if failed is not None:
            self._reply(r.worker, failed)
        elif r.op == FETCH and table.check_ids(r.data[0]) is not None:
            self._reply(r.worker, (BAD_IDS, r.step, 0, 0))
        elif r.op == LAG:
            self._reply(r.worker, (OK, table.max_lag, 0, 0))
        elif r.op == LOAD:
            table.load(r.data[0], r.data[1] if r.flag else None, r.step)
            self._reply(r.worker, (OK, 0, 0, 0))
        else:  # FETCH, EXPORT: now, or when the pushes they wait for are applied
            self.waiting.append(r)

    def _retry(self) -> None:
        still = []
        for r in self.waiting:
            table = self.tables[r.table]
            fetch = r.op == FETCH
            if table.ready(r.step) if fetch else table.settled(r.step):
                if fetch:
                    training = bool(r.flag & TRAINING)
                    rows = table.read(r.worker, r.step, r.data[0], training)
                    self._reply(r.worker, (OK, 0, 0, 0), [rows])
                else:
                    rows, sums = table.export()
                    self._reply(r.worker, (OK, 0, 0, 0), [rows] if sums is None else [rows, sums])
                continue
            needed = r.step - table.config.staleness if fetch else r.step
            left = table.missing(needed, self.gone)
            if left is not None:
                self._reply(r.worker, (LEFT, left, table.pushed[left], needed))
            else:
                still.append(r)
        self.waiting = still

    def _reply(
        self, worker: int, status: tuple[int, int, int, int], data: list[torch.Tensor] | None = None
    ) -> None:
        dst = self.worker_ranks[worker]
        reply = torch.tensor(status, dtype=torch.int64)
        self.sending.append((dist.isend(reply, dst=dst, group=self.group, tag=REPLY), reply))
        for tensor in data or []:
            tensor = tensor.contiguous()
            self.sending.append((dist.isend(tensor, dst=dst, group=self.group, tag=ROWS), tensor))


# -- the worker's end ------------------------------------------------------------------------


class Wire:
    """A worker's requests to the servers. One request at a time (a lock): the replies of
    one server to this worker then come in the order they were asked for. The receives of a
    reply and its tensors are posted before the request leaves (their sizes are known), so
    the server's answer goes out without waiting for them."""

    def __init__(
        self,
        group: Any,
        worker: int,
        server_ranks: list[int],
        shapes: list[list[Shape]],  # [table][server]
        timeout_s: float,
    ):
        self.group = group
        self.worker = worker
        self.server_ranks = server_ranks
        self.shapes = shapes
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.sending: list[tuple[Any, torch.Tensor]] = []  # isends in flight, kept alive
        self.closed = False
        self.broken: str | None = None  # an error reply: its tensors' receives are still posted

    # -- requests ---------------------------------------------------------------------------

    def fetch(
        self, table: int, step: int, ids: list[torch.Tensor], training: bool
    ) -> list[torch.Tensor]:
        """Rows ``ids[j]`` (local indices) from every server j, for this worker's ``step``."""
        flag = TRAINING if training else 0
        with self.lock:
            asked = [
                self._ask(
                    j,
                    (
                        FETCH,
                        table,
                        step,
                        part.numel(),
                        flag | (WIDE if part.dtype == torch.int64 else 0),
                    ),
                    [part],
                    table,
                    [part.numel()],
                )
                for j, part in enumerate(ids)
            ]
            return [self._answer(j, a, f"step {step}'s rows")[1][0] for j, a in enumerate(asked)]

    def push(self, table: int, step: int, grads: list[torch.Tensor]) -> None:
        """Send every server j its rows' gradients ``grads[j]`` (no reply; an error in them
        comes with the reply to this worker's next request)."""
        with self.lock:
            for j, g in enumerate(grads):
                self._send(j, (PUSH, table, step, g.shape[0], 0), [g])

    def lag(self, table: int) -> list[int]:
        with self.lock:
            asked = [self._ask(j, (LAG, table, 0, 0, 0), [], table, []) for j in self._servers()]
            return [self._answer(j, a, "its lag")[0][1] for j, a in enumerate(asked)]

    def export(self, table: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every server's share of the table, and its Adagrad sums (adagrad), once every
        worker's pushes up to ``step`` are applied."""
        with self.lock:
            asked = []
            for j in self._servers():
                shape = self.shapes[table][j]
                counts = [shape.share] * (2 if shape.sums else 1)
                asked.append(self._ask(j, (EXPORT, table, step, 0, 0), [], table, counts))
            out = []
            for j, a in enumerate(asked):
                got = self._answer(j, a, f"step {step}'s table")[1]
                out.append((got[0], got[1] if len(got) > 1 else None))
        return out

    def load(
        self, table: int, step: int, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        with self.lock:
            asked = []
            for j, (rows, sums) in enumerate(parts):
                data = [rows] if sums is None else [rows, sums]
                header = (LOAD, table, step, 0, int(sums is not None))
                asked.append(self._ask(j, header, data, table, []))
            for j, a in enumerate(asked):
                self._answer(j, a, "the loaded table")

    def settle(self) -> None:
        """Wait until the requests sent so far have left."""
        with self.lock:
            self._drain()

    def close(self) -> None:
        """BYE to every server (after this worker's last push): they exit once all said it."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for j in self._servers():
                self._send(j, (BYE, 0, 0, 0, 0), [])
            self._drain()

    # -- the messages -----------------------------------------------------------------------

    def _servers(self) -> range:
        return range(len(self.server_ranks))

    def _send(
        self, j: int, header: tuple[int, int, int, int, int], data: list[torch.Tensor]
    ) -> None:
        if header[0] != BYE and (self.closed or self.broken):
            why = self.broken or "this worker said it is done (shutdown)"
            raise RuntimeError(f"parameter server: no more requests from this worker: {why}")
        dst = self.server_ranks[j]
        head = torch.tensor(header, dtype=torch.int64)
        self.sending.append((dist.isend(head, dst=dst, group=self.group, tag=HEAD), head))
        for tensor in data:
            tensor = tensor.contiguous()
            self.sending.append((dist.isend(tensor, dst=dst, group=self.group, tag=DATA), tensor))
        self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]

    def _drain(self) -> None:
        sending, self.sending = self.sending, []
        for work, _ in sending:
            self._wait(work, "sending to a server")

    def _ask(
        self,
        j: int,
        header: tuple[int, int, int, int, int],
        data: list[torch.Tensor],
        table: int,
        counts: list[int],
    ) -> tuple[torch.Tensor, list[Any], list[torch.Tensor]]:
        """Post the receives of server j's reply and of its tensors (``counts`` rows of the
        table each), then send the request."""
        src = self.server_ranks[j]
        reply = torch.empty(REPLY_FIELDS, dtype=torch.int64)
        shape = self.shapes[table][j]
        out = [torch.empty(n, shape.dim, dtype=shape.dtype) for n in counts]
        works = [dist.irecv(reply, src=src, group=self.group, tag=REPLY)]
        works += [dist.irecv(t, src=src, group=self.group, tag=ROWS) for t in out]
        self._send(j, header, data)
        return reply, works, out

    def _answer(
        self, j: int, asked: tuple[torch.Tensor, list[Any], list[torch.Tensor]], what: str
    ) -> tuple[list[int], list[torch.Tensor]]:
        reply, works, out = asked
        self._wait(works[0], f"waiting for server {j}'s reply ({what})")
        status = reply.tolist()
        if status[0] != OK:
            self.broken = self._explain(j, status)
            raise RuntimeError(self.broken)
        for work in works[1:]:
            self._wait(work, f"receiving server {j}'s {what}")
        return status, out

    def _wait(self, work: Any, what: str) -> None:
        start = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if time.monotonic() - start >= self.timeout_s * 0.99:
                raise TimeoutError(
                    f"parameter server: worker {self.worker} spent {self.timeout_s:g} s"
                    f" {what}: another worker has not pushed its step (stopped, slower than that,"
                    " or not using this table every step)"
                ) from None
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RuntimeError(
                f"parameter server: worker {self.worker} lost its connection while {what}"
                f" (the other end stopped?): {text}"
            ) from None

    def _explain(self, j: int, status: list[int]) -> str:
        code, a, b, c = status
        head = f"parameter server {j}: worker {self.worker}"
        if code == LEFT:
            return (
                f"{head}'s request needs worker {a}'s push for its step {c - 1}, but worker {a}"
                f" said it was done after {b} step{'s' * (b != 1)}"
            )
        if code == NO_FETCH:
            return (
                f"{head} pushed gradients for step {a} without a matching training fetch (one"
                " training forward per table per step)"
            )
        if code == BAD_IDS:
            return f"{head} asked for rows outside the table at step {a}"
        return f"{head}: unknown reply {status}"
