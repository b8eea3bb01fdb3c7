"""A parameter server for embedding tables: plan style ``"server"`` of ``mg.parallelize``.

    model = mg.parallelize(model, servers=2, tp_plan={"emb": "server"},
                           server_optimizer="adagrad", server_lr=0.05, staleness=0)

Layout. A job of W + S ranks: ranks 0..W-1 are **workers** (they run the
training loop), the last S are **servers**. Row ``r`` of a planned table lives
on server ``r % S`` at local index ``r // S`` (round robin, so a block of hot
low ids is spread over every server). A server holds its rows and their
optimizer state (SGD, or Adagrad's sum of squares) and applies sparse row
updates (``param_server_table``); workers hold no copy of the table. The rest of
the model is data-parallel among the workers as usual (a worker-only process group).

One step of a worker, for each planned table, as tensors sent point to point on a
gloo group of the whole job (``param_server_wire``: nothing is unpickled, no
listener of its own; ``torch.distributed.rpc`` only where a program asks for it,
``param_server_rpc``):

    forward:  ids -> unique ids U -> fetch(U's ids on server j) from every server j
              (ids go out once, U rows come back) -> the layer's math on the U rows
    backward: a hook on the U rows pushes their gradient rows to their servers
              (rows only: a server pairs them with the ids of this worker's fetch)

So a step moves U x 4 bytes of ids (int32) plus 2 x U rows, whatever the table's size
(and a 40-byte header and a 32-byte reply per message, per server).

Consistency (``staleness=s``). Each server counts, per table and per worker,
the pushes it has applied. A worker's fetch for its step t (t pushes done)
waits until every worker's pushes up to step t - s are applied:

- ``s = 0``: synchronous. A server keeps a step's pushes until all W have
  come, then applies their sum (in worker order, divided by W, as data
  parallelism averages gradients) once; the next fetch waits for that. This is
  the serial program: a batch of all workers' samples, one optimizer step.
- ``s > 0``: each push is applied when it comes (divided by W, Hogwild-style);
  a worker may read rows that lack up to s steps of the other workers'
  updates, and never more.

Server ranks never return from ``apply_param_server``: they serve until every
worker has said it is done (``shutdown()``, also run at exit), then raise
``SystemExit(0)``. Limits: one training forward per table per step (no
gradient accumulation), every worker uses each table every step, no tensor
parallelism with servers, tables on the CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from macrogen.runtime import environment
from macrogen.runtime.mesh import SERIAL, Mesh, carry, mesh
from macrogen.runtime.param_server_table import ServerConfig, ServerTable
from macrogen.runtime.param_server_wire import ProtocolError, Server, Shape, Wire, share_of

__all__ = ["ServerConfig", "ServerPlanError", "apply_param_server", "apply_server_tables"]

OPTIMIZERS = ("sgd", "adagrad")
TRANSPORTS = ("p2p", "rpc")
TRANSPORT_ENV = "MACROGEN_SERVER_TRANSPORT"  # "rpc": torch RPC (trusts its network; docs/async.md)
_FOREVER = datetime.timedelta(days=365)  # a server waits this long for a worker's next request


# -- the worker side ---------------------------------------------------------------------------


@dataclass
class Traffic:
    """Tensor bytes this worker sent and received, by kind (ids, rows, gradients); the
    headers and replies around them are not counted."""

    ids: int = 0
    rows: int = 0
    grads: int = 0
    touched: int = 0  # bytes of the unique rows the worker's batches used

    @property
    def total(self) -> int:
        return self.ids + self.rows + self.grads


@dataclass
class _Client:
    key: str  # the layer's path
    index: int  # the table's number on the servers (the plan's order, the same on every rank)
    module: nn.Module
    rows: int
    servers: int
    wire: Any  # param_server_wire.Wire, or param_server_rpc.RpcWire
    step: int = 0  # pushes done
    fetches: int = 0  # training fetches so far
    pending: int = 0  # the training fetch whose rows' gradient is pushed next (0: none)
    traffic: Traffic = field(default_factory=Traffic)

    def lookup(
        self, ids: torch.Tensor, padding_idx: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The unique rows ``ids`` use (fetched), ``ids`` renumbered into them, and the padding
        row's new number (None: the batch does not use it)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{self.key}: indices must be int64 or int32, not {ids.dtype}")
        unique, inverse = torch.unique(ids.long(), return_inverse=True)
        if unique.numel() and not (0 <= int(unique[0]) and int(unique[-1]) < self.rows):
            raise IndexError(f"{self.key}: index out of range for a table of {self.rows} rows")
        training = torch.is_grad_enabled()
        owner = unique % self.servers
        masks = [owner == j for j in range(self.servers)]
        parts = []
        for mask in masks:
            local = unique[mask] // self.servers
            if self.rows // self.servers < 2**31:  # int32 on the wire: half the ids' bytes
                local = local.int()
            self.traffic.ids += local.numel() * local.element_size()
            parts.append(local)
        got = self.wire.fetch(self.index, self.step, parts, training)
        dtype, dim = self.module.__dict__["_mg_server_meta"]
        rows = torch.empty(unique.numel(), dim, dtype=dtype)
        for mask, part in zip(masks, got):
            self.traffic.rows += part.numel() * part.element_size()
            rows[mask] = part
        if training:
            self.traffic.touched += rows.numel() * rows.element_size()
            rows.requires_grad_(True)
            self.fetches += 1
            self.pending = token = self.fetches  # (a token, not the rows: no reference cycle)
            rows.register_hook(lambda g: self._send(token, masks, g))
        pad = None
        if padding_idx is not None:
            hit = (unique == padding_idx).nonzero()
            pad = int(hit[0, 0]) if hit.numel() else None
        return rows, inverse, pad

    def _send(self, token: int, masks: list[torch.Tensor], grad: torch.Tensor) -> None:
        if token != self.pending:
            raise RuntimeError(
                f"{self.key}: two training forwards before one backward: a server table takes"
                " one forward per step (no gradient accumulation)"
            )
        self.pending = 0
        dtype = self.module.__dict__["_mg_server_meta"][0]
        grads = [grad[mask].detach().to(dtype).contiguous() for mask in masks]
        self.traffic.grads += sum(g.numel() * g.element_size() for g in grads)
        self.wire.push(self.index, self.step, grads)
        self.step += 1


def _embedding_forward(client: _Client, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    rows, inverse, pad = client.lookup(ids, module.padding_idx)
    return F.embedding(inverse, rows, pad)


def _bag_forward(
    client: _Client,
    module: nn.EmbeddingBag,
    ids: torch.Tensor,
    offsets: torch.Tensor | None = None,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    rows, inverse, pad = client.lookup(ids, module.padding_idx)
    return F.embedding_bag(
        inverse,
        rows,
        offsets,
        mode=module.mode,
        per_sample_weights=per_sample_weights,
        include_last_offset=module.include_last_offset,
        padding_idx=pad,
    )


# -- set-up -------------------------------------------------------------------------------------


class ServerPlanError(ValueError):
    """A "server" plan entry that does not fit its layer."""


def check_layer(name: str, layer: Any) -> str | None:
    """Why ``layer`` cannot be a server table (None: it can)."""
    if not isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        return (
            f"{name}: server needs an nn.Embedding or nn.EmbeddingBag, not {type(layer).__name__}"
        )
    if layer.max_norm is not None or layer.scale_grad_by_freq:
        return f"{name}: server supports tables without max_norm and scale_grad_by_freq"
    if layer.weight.device.type != "cpu":
        return f"{name}: server tables live on the CPU; build the table on the CPU"
    return None


def apply_server_tables(
    model: nn.Module,
    paths: list[str],
    config: ServerConfig,
    *,
    where: str,
    data_parallel: Any = None,
) -> nn.Module:
    """``mg.parallelize``'s step for the plan's "server" entries: each path (``*`` is any
    child) names an nn.Embedding or nn.EmbeddingBag; checked serially too."""
    from macrogen.runtime.parallelize import _matches

    layers: list[tuple[str, Any]] = []
    problems = []
    for path in paths:
        hits = [(name, getattr(owner, attr)) for name, owner, attr in _matches(model, path)]
        if not hits:
            problems.append(f"{path}: matches nothing in {type(model).__name__}")
        for name, layer in hits:
            problem = check_layer(name, layer)
            if problem:
                problems.append(problem)
            else:
                layers.append((name, layer))
    if problems:
        raise ServerPlanError(f"mg.parallelize at {where}: " + "; ".join(problems))
    return apply_param_server(model, layers, config, where=where, data_parallel=data_parallel)


def apply_param_server(
    model: nn.Module,
    layers: list[tuple[str, Any]],  # (path, nn.Embedding or nn.EmbeddingBag)
    config: ServerConfig,
    *,
    where: str,
    data_parallel: Any = None,
) -> nn.Module:
    """Move ``layers``' tables to the server ranks (the last ``config.servers``); see the module
    docstring. On a worker returns ``model``; a server serves, then raises ``SystemExit(0)``.
    ``data_parallel`` (a ``DataParallelConfig``) averages the rest over the workers."""
    S = config.servers
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"mg.parallelize at {where}: server_optimizer={config.optimizer!r}")
    if config.staleness < 0 or config.lr <= 0 or S < 1:
        raise ValueError(f"mg.parallelize at {where}: {config}: needs servers >= 1, staleness >= 0,"
                         " lr > 0")  # fmt: skip
    if config.transport not in (None, *TRANSPORTS):
        raise ValueError(f"mg.parallelize at {where}: transport={config.transport!r}: expected"
                         f" one of {', '.join(TRANSPORTS)}")  # fmt: skip
    if not dist.is_initialized() or dist.get_world_size() == 1:
        carry(model, SERIAL)  # (mg.mesh(model))
        return model  # serial: the table stays in the model
    world = dist.get_world_size()
    W = world - S
    if W < 1:
        raise ValueError(
            f"mg.parallelize at {where}: servers={S} leaves no worker in a job of {world} ranks"
        )
    problems = [p for p in (check_layer(n, m) for n, m in layers) if p]
    shared = {id(p) for _, m in layers for p in [m.weight]}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in shared and not any(name == f"{n}.weight" for n, _ in layers):
            problems.append(f"{name} is tied to a server table: untie it")
    if problems:
        raise ServerPlanError(f"mg.parallelize at {where}: " + "; ".join(problems))
    global _started
    if _started:  # a server rank serves one model's tables, then leaves
        raise RuntimeError(
            f"mg.parallelize at {where}: a second model with server tables in this process:"
            " build one such model per job"
        )
    _started = True
    transport = _agreed_transport(config, where)
    mesh()  # the program's, made now while every rank is here (a later mg.mesh() needs them all)
    rank = dist.get_rank()
    workers = dist.new_group(list(range(W)))  # every rank takes part in making a group
    # resumable's checkpoints run on a worker group of their own (its save thread's collectives
    # must not interleave with the training loop's), made now: the servers leave below
    checkpoints = dist.new_group(list(range(W)), backend="gloo")
    for _, layer in layers:  # rank 0's initial table, as data parallelism starts from rank 0's
        dist.broadcast(layer.weight.data, src=0)
    # the tables' traffic: a gloo group of the whole job (the servers wait for requests
    # as long as the job runs; a worker's waits are bounded by config.timeout_s)
    group = None
    if transport == "p2p":
        group = dist.new_group(list(range(world)), backend="gloo", timeout=_FOREVER)
    if rank >= W:
        j = rank - W
        tables = [ServerTable(m.weight.detach()[j::S].clone(), config, W) for _, m in layers]
        _serve(tables, group, W, rank, world, config)
    wire: Any
    if group is not None:
        shapes = [
            [
                Shape(
                    share_of(m.num_embeddings, j, S),
                    m.embedding_dim,
                    m.weight.dtype,
                    sums=config.optimizer == "adagrad",
                )  # fmt: skip
                for j in range(S)
            ]
            for _, m in layers
        ]
        wire = Wire(group, rank, list(range(W, world)), shapes, config.timeout_s)
    else:
        from macrogen.runtime import param_server_rpc

        param_server_rpc.start(rank, world, W, None, config)
        wire = param_server_rpc.RpcWire(rank, S)
    clients = []
    for index, (name, layer) in enumerate(layers):
        client = _Client(name, index, layer, layer.num_embeddings, S, wire)
        weight = layer._parameters.pop("weight")
        layer.__dict__["_mg_server_meta"] = (weight.dtype, weight.shape[1])
        layer.__dict__["_mg_server"] = client
        forward = _bag_forward if isinstance(layer, nn.EmbeddingBag) else _embedding_forward
        layer.__dict__["forward"] = _bound(forward, client, layer)
        clients.append(client)
    model.__dict__["_mg_param_server"] = _Job(clients, workers, W, S, config, wire, checkpoints)
    _OPEN.append(wire)
    atexit.register(_close_quietly, wire)
    # the model's data ranks are the workers: its mesh, which its data parallelism is handed
    workers_mesh = Mesh(W, 1, None, workers, data_rank=rank)
    carry(model, workers_mesh)
    if data_parallel is not None and W > 1:
        _worker_data_parallel(model, data_parallel, workers_mesh, where)
    return model


def _serve(
    tables: list[ServerTable], group: Any, W: int, rank: int, world: int, config: ServerConfig
) -> None:
    """A server rank: answer the workers until every one is done, then leave the program."""
    if group is None:
        from macrogen.runtime import param_server_rpc

        param_server_rpc.start(rank, world, W, tables, config)
        param_server_rpc.serve()
        raise SystemExit(0)
    try:
        Server(tables, group, list(range(W))).serve()
    except ProtocolError as e:  # a worker stopped, or bytes that are no request: one line
        # and out at once: the other workers' readers are still blocked in recv, and an
        # interpreter finalizing around them aborts ("terminate called without an active
        # exception", SIGABRT) instead of exiting 1. The job is over (torchrun restarts it).
        print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    raise SystemExit(0)


def _agreed_transport(config: ServerConfig, where: str) -> str:
    """The transport every rank was started with (one all-gather): RPC only where asked."""
    transport = config.transport or environment.choice(TRANSPORT_ENV, "p2p", TRANSPORTS)
    mine = torch.tensor([TRANSPORTS.index(transport)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    chosen = {TRANSPORTS[int(t)] for t in every}
    if len(chosen) > 1:
        ranks = [r for r, t in enumerate(every) if TRANSPORTS[int(t)] != TRANSPORTS[int(every[0])]]
        raise ValueError(
            f"mg.parallelize at {where}: the ranks disagree on the server transport: rank 0 has"
            f" {TRANSPORTS[int(every[0])]!r}, rank {ranks[0]} {TRANSPORTS[int(every[ranks[0]])]!r}"
            f" (set {TRANSPORT_ENV} the same on every rank)"
        )
    return transport


def _bound(fn: Any, client: _Client, layer: nn.Module) -> Any:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = fn(client, layer, *args, **kwargs)
        return out

    return forward


@dataclass
class _Job:
    clients: list[_Client]
    workers: dist.ProcessGroup  # the worker-only group
    W: int
    S: int
    config: ServerConfig
    wire: Any  # this worker's end of the tables' traffic
    checkpoints: Any = None  # the workers' group for resumable's DCP saves and loads


def _worker_data_parallel(model: nn.Module, config: Any, workers: Mesh, where: str) -> None:
    """GradientSync over the workers only (the default group holds the servers too)."""
    from macrogen.runtime.data_parallel import GradientSync

    model.__dict__["_mg_gradient_sync"] = GradientSync(model, config, where=where, mesh=workers)


def job_of(model: nn.Module) -> _Job | None:
    """The model's server job (None: no server tables, or a serial run)."""
    found: _Job | None = model.__dict__.get("_mg_param_server")
    return found


def job(model: nn.Module) -> _Job:
    found = job_of(model)
    if found is None:
        raise ValueError("this model has no server tables (mg.parallelize(..., servers=S))")
    return found


def traffic(model: nn.Module) -> dict[str, Traffic]:
    """This worker's tensor bytes per server table so far."""
    return {c.key: c.traffic for c in job(model).clients}


def max_lag(model: nn.Module) -> dict[str, int]:
    """Per server table, the most steps any fetch so far lacked of some worker's pushes
    (never above ``staleness``; 0 when synchronous)."""
    j_ = job(model)
    return {c.key: max(j_.wire.lag(c.index)) for c in j_.clients}


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The server tables, whole, and their optimizer state, after this worker's last step's
    pushes are applied everywhere: ``{path}.weight``, ``{path}.adagrad_sum``, ``{path}.step``.
    Any worker may call it alone (rank 0, to save); with staleness 0 every worker gets the same."""
    j_ = job(model)
    out: dict[str, torch.Tensor] = {}
    for c in j_.clients:
        parts = j_.wire.export(c.index, c.step)
        dtype, dim = c.module.__dict__["_mg_server_meta"]
        rows = torch.empty(c.rows, dim, dtype=dtype)
        for j, (r, _) in enumerate(parts):
            rows[j :: c.servers] = r
        out[f"{c.key}.weight"] = rows
        if parts[0][1] is not None:
            total = torch.empty_like(rows)
            for j, (_, s) in enumerate(parts):
                total[j :: c.servers] = s
            out[f"{c.key}.adagrad_sum"] = total
        out[f"{c.key}.step"] = torch.tensor(c.step)
    return out


def load_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every worker calls it with the same ``state`` (worker 0 sends the rows to the servers;
    the others wait for that) before the first step: the tables and step counts resume."""
    j_ = job(model)
    for c in j_.clients:
        step = int(state[f"{c.key}.step"])
        if dist.get_rank(j_.workers) == 0:
            rows = state[f"{c.key}.weight"]
            total = state.get(f"{c.key}.adagrad_sum")
            if j_.config.optimizer != "adagrad":
                total = None
            parts = [
                (
                    rows[j :: c.servers].contiguous(),
                    None if total is None else total[j :: c.servers].contiguous(),
                )
                for j in range(c.servers)
            ]
            j_.wire.load(c.index, step, parts)
        c.step = step
    dist.barrier(group=j_.workers)


def checkpoint_state(model: nn.Module, *, load: bool) -> dict[str, torch.Tensor]:
    """The server tables' part of a ``resumable`` checkpoint (DCP, over the workers' group; the
    servers take no part in it): worker 0 pulls the tables whole with their optimizer state
    (``state_dict``), every worker adds its step counts (DCP stores one copy of a key). For a
    load (``load``): tensors of those shapes to read into, then ``load_state_dict``."""
    j_ = job(model)
    first = dist.get_rank(j_.workers) == 0
    if first and not load:
        return state_dict(model)
    out: dict[str, torch.Tensor] = {}
    for c in j_.clients:
        if first:
            dtype, dim = c.module.__dict__["_mg_server_meta"]
            out[f"{c.key}.weight"] = torch.empty(c.rows, dim, dtype=dtype)
            if j_.config.optimizer == "adagrad":
                out[f"{c.key}.adagrad_sum"] = torch.empty(c.rows, dim, dtype=dtype)
        out[f"{c.key}.step"] = torch.tensor(c.step)
    return out


_started = False  # this process made a model with server tables (one per process)
_OPEN: list[Any] = []  # the wires this process opened, for shutdown()


def shutdown(model: nn.Module | None = None) -> None:
    """Tell the servers this worker is done (after its last push): they exit once every
    worker has. ``model``: that model's tables; None: every model's in this process. Also
    run at exit."""
    wires = [job(model).wire] if model is not None else list(_OPEN)
    for wire in wires:
        wire.close()


def _close_quietly(wire: Any) -> None:
    """At exit: the process group may be gone already (the program destroyed it)."""
    with contextlib.suppress(Exception):
        wire.close()
