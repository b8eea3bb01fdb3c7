"""A parameter server for embedding tables: plan style ``"server"`` of ``mg.parallelize``.

    model = mg.parallelize(model, servers=2, tp_plan={"emb": "server"},
                           server_optimizer="adagrad", server_lr=0.05, staleness=0)

Layout. A job of W + S ranks: ranks 0..W-1 are **workers** (they run the
training loop), the last S are **servers**. Row ``r`` of a planned table lives
on server ``r % S`` at local index ``r // S`` (round robin, so a block of hot
low ids is spread over every server). A server holds its rows and their
optimizer state (SGD, or Adagrad's sum of squares) and applies sparse row
updates; workers hold no copy of the table. The rest of the model is
data-parallel among the workers as usual (a worker-only process group).

One step of a worker, for each planned table, over ``torch.distributed.rpc``
(TensorPipe), torch's parameter-server tutorial pattern:

    forward:  ids -> unique ids U -> fetch(U's ids on server j) from every server j
              (ids go out once, U rows come back) -> the layer's math on the U rows
    backward: a hook on the U rows pushes their gradient rows to their servers
              (rows only: a server pairs them with the ids of this worker's fetch)

So a step moves U x 4 bytes of ids (int32) plus 2 x U rows, whatever the table's size.

Consistency (``staleness=s``). Each server counts, per table and per worker,
the pushes it has applied. A worker's fetch for its step t (t pushes done)
waits until every worker's pushes up to step t - s are applied:

- ``s = 0``: synchronous. A server keeps a step's pushes until all W have
  come, then applies their sum (in worker order, divided by W, as data
  parallelism averages gradients) once; the next fetch waits for that. This is
  the serial program: a batch of all workers' samples, one optimizer step.
- ``s > 0``: each push is applied when it comes (divided by W, Hogwild-style
  under the table's lock); a worker may read rows that lack up to s steps of
  the other workers' updates, and never more.

Server ranks never return from ``apply_param_server``: they serve until every
worker has shut the RPC agent down (``shutdown()``, also run at exit), then
raise ``SystemExit(0)``. Limits: one training forward per table per step (no
gradient accumulation), every worker uses each table every step, no tensor
parallelism with servers, tables on the CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

OPTIMIZERS = ("sgd", "adagrad")
_WORKER = "mg_ps_worker{}"
_SERVER = "mg_ps_server{}"


@dataclass(frozen=True)
class ServerConfig:
    servers: int  # S: the last S ranks of the job hold the planned tables
    staleness: int = 0  # steps a worker may run ahead of the slowest push (0: synchronous)
    optimizer: str = "sgd"  # "sgd" or "adagrad" (torch's rules, lr_decay 0, no weight decay)
    lr: float = 0.01
    eps: float = 1e-10  # adagrad
    initial_accumulator_value: float = 0.0  # adagrad
    timeout_s: float = 300.0  # a fetch waiting longer for the other workers' pushes fails


# -- the server side (tables live in the server processes' globals) ------------------------


class _Table:
    """One table's rows on one server, their optimizer state, and the step bookkeeping."""

    def __init__(self, rows: torch.Tensor, config: ServerConfig, workers: int):
        self.rows = rows
        self.config = config
        self.workers = workers
        adagrad = config.optimizer == "adagrad"
        self.sum = torch.full_like(rows, config.initial_accumulator_value) if adagrad else None
        self.cond = threading.Condition()
        self.applied = [0] * workers  # pushes applied, per worker
        self.waiting: dict[int, dict[int, torch.Tensor]] = {}  # s=0: step -> worker -> grads
        self.fetched: dict[int, torch.Tensor] = {}  # worker -> ids of its last training fetch
        self.waiting_ids: dict[int, dict[int, torch.Tensor]] = {}
        self.max_lag = 0  # the most steps a fetch's rows lacked of some worker's pushes

    def ready(self, step: int) -> bool:
        return min(self.applied) >= step - self.config.staleness

    def fetch(self, worker: int, step: int, ids: torch.Tensor, training: bool) -> torch.Tensor:
        ids = ids.long()
        with self.cond:
            if not self.cond.wait_for(lambda: self.ready(step), self.config.timeout_s):
                raise TimeoutError(
                    f"parameter server: worker {worker}'s step {step} waited"
                    f" {self.config.timeout_s:g} s for the other workers' pushes"
                    f" (applied per worker: {self.applied})"
                )
            self.max_lag = max(self.max_lag, step - min(self.applied))
            if training:
                self.fetched[worker] = ids
            return self.rows.index_select(0, ids)

    def push(self, worker: int, step: int, grads: torch.Tensor) -> None:
        with self.cond:
            ids = self.fetched.pop(worker, None)
            if ids is None or ids.numel() != grads.shape[0]:
                raise RuntimeError(
                    f"parameter server: worker {worker} pushed gradients for step {step} without"
                    " a matching training fetch (one training forward per table per step)"
                )
            if self.config.staleness > 0:
                self._apply(ids, grads)
                self.applied[worker] += 1
            else:
                self.waiting.setdefault(step, {})[worker] = grads
                self.waiting_ids.setdefault(step, {})[worker] = ids
                if len(self.waiting[step]) == self.workers:
                    grads_by, ids_by = self.waiting.pop(step), self.waiting_ids.pop(step)
                    order = range(self.workers)  # worker order: the same sum on every run
                    self._apply(
                        torch.cat([ids_by[w] for w in order]),
                        torch.cat([grads_by[w] for w in order]),
                    )
                    self.applied = [step + 1] * self.workers
            self.cond.notify_all()

    def _apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on the rows ``ids`` (repeats summed first), gradients / W."""
        if ids.numel() == 0:
            return
        unique, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(unique.numel(), *grads.shape[1:], dtype=grads.dtype)
        g.index_add_(0, inverse, grads)
        g.div_(self.workers)
        lr = self.config.lr
        if self.sum is None:  # SGD: p <- p - lr g
            self.rows.index_copy_(0, unique, self.rows.index_select(0, unique).add(g, alpha=-lr))
            return
        # Adagrad (torch's rule): s <- s + g^2; p <- p - lr g / (sqrt(s) + eps)
        s = self.sum.index_select(0, unique).addcmul_(g, g, value=1)
        self.sum.index_copy_(0, unique, s)
        std = s.sqrt().add_(self.config.eps)
        self.rows.index_copy_(
            0, unique, self.rows.index_select(0, unique).addcdiv_(g, std, value=-lr)
        )

    def export(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        with self.cond:
            if not self.cond.wait_for(lambda: min(self.applied) >= step, self.config.timeout_s):
                raise TimeoutError(f"parameter server: step {step}'s pushes never all came")
            rows = self.rows.clone()
            return rows, None if self.sum is None else self.sum.clone(), list(self.applied)

    def load(self, rows: torch.Tensor, sum_: torch.Tensor | None, step: int) -> None:
        with self.cond:
            self.rows.copy_(rows)
            if self.sum is not None and sum_ is not None:
                self.sum.copy_(sum_)
            self.applied = [step] * self.workers
            self.waiting.clear()
            self.waiting_ids.clear()
            self.fetched.clear()
            self.cond.notify_all()


_started = False  # this process started its RPC agent
_TABLES: dict[str, _Table] = {}  # on a server: the planned tables' rows it holds, by path


# Module-level functions: RPC pickles them by name and runs them on the server.
def _fetch(key: str, worker: int, step: int, ids: torch.Tensor, training: bool) -> torch.Tensor:
    return _TABLES[key].fetch(worker, step, ids, training)


def _push(key: str, worker: int, step: int, grads: torch.Tensor) -> None:
    _TABLES[key].push(worker, step, grads)


def _lag(key: str) -> int:
    return _TABLES[key].max_lag


def _export(key: str, step: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    return _TABLES[key].export(step)


def _load(key: str, rows: torch.Tensor, sum_: torch.Tensor | None, step: int) -> None:
    _TABLES[key].load(rows, sum_, step)


# -- the worker side ---------------------------------------------------------------------------


@dataclass
class Traffic:
    """Tensor bytes this worker sent and received over RPC, by kind (ids, rows, gradients)."""

    ids: int = 0
    rows: int = 0
    grads: int = 0
    touched: int = 0  # bytes of the unique rows the worker's batches used

    @property
    def total(self) -> int:
        return self.ids + self.rows + self.grads


@dataclass
class _Client:
    key: str  # the layer's path: the table's name on the servers
    module: nn.Module
    rows: int
    worker: int
    servers: int
    step: int = 0  # pushes done
    fetches: int = 0  # training fetches so far
    pending: int = 0  # the training fetch whose rows' gradient is pushed next (0: none)
    futures: list[Any] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)

    def settle(self) -> None:
        """Wait for the pushes in flight (their errors surface here)."""
        futures, self.futures = self.futures, []
        for f in futures:
            f.wait()

    def lookup(
        self, ids: torch.Tensor, padding_idx: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The unique rows ``ids`` use (fetched), ``ids`` renumbered into them, and the padding
        row's new number (None: the batch does not use it)."""
        from torch.distributed import rpc

        self.settle()
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{self.key}: indices must be int64 or int32, not {ids.dtype}")
        unique, inverse = torch.unique(ids.long(), return_inverse=True)
        training = torch.is_grad_enabled()
        owner = unique % self.servers
        masks = [owner == j for j in range(self.servers)]
        futures = []
        for j, mask in enumerate(masks):
            local = unique[mask] // self.servers
            if self.rows // self.servers < 2**31:  # int32 on the wire: half the ids' bytes
                local = local.int()
            self.traffic.ids += local.numel() * local.element_size()
            futures.append(
                rpc.rpc_async(
                    _SERVER.format(j),
                    _fetch,
                    args=(self.key, self.worker, self.step, local, training),
                )
            )
        weight_like = self.module.__dict__["_mg_server_meta"]
        rows = torch.empty(unique.numel(), weight_like[1], dtype=weight_like[0])
        for mask, fut in zip(masks, futures):
            got = fut.wait()
            self.traffic.rows += got.numel() * got.element_size()
            rows[mask] = got
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
        from torch.distributed import rpc

        if token != self.pending:
            raise RuntimeError(
                f"{self.key}: two training forwards before one backward: a server table takes"
                " one forward per step (no gradient accumulation)"
            )
        self.pending = 0
        for j, mask in enumerate(masks):
            g = grad[mask].detach().contiguous()
            self.traffic.grads += g.numel() * g.element_size()
            self.futures.append(
                rpc.rpc_async(_SERVER.format(j), _push, args=(self.key, self.worker, self.step, g))
            )
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
    from torch.distributed import rpc

    S = config.servers
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"mg.parallelize at {where}: server_optimizer={config.optimizer!r}")
    if config.staleness < 0 or config.lr <= 0 or S < 1:
        raise ValueError(f"mg.parallelize at {where}: {config}: needs servers >= 1, staleness >= 0,"
                         " lr > 0")  # fmt: skip
    if not dist.is_initialized() or dist.get_world_size() == 1:
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
    if _started:  # torch's RPC agent starts once per process
        raise RuntimeError(
            f"mg.parallelize at {where}: a second model with server tables in this process:"
            " build one such model per job"
        )
    _started = True
    from macrogen.runtime.mesh import mesh

    mesh()  # made by every rank now: the workers' data parallelism reads it later
    rank = dist.get_rank()
    workers = dist.new_group(list(range(W)))  # every rank takes part in making a group
    # resumable's checkpoints run on a worker group of their own (its save thread's collectives
    # must not interleave with the training loop's), made now: the servers leave below
    checkpoints = dist.new_group(list(range(W)), backend="gloo")
    for _, layer in layers:  # rank 0's initial table, as data parallelism starts from rank 0's
        dist.broadcast(layer.weight.data, src=0)
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    serving = rank >= W
    if serving:
        j = rank - W
        for name, layer in layers:
            _TABLES[name] = _Table(layer.weight.detach()[j::S].clone(), config, W)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port[0]}",
        rpc_timeout=config.timeout_s + 30,
        num_worker_threads=max(16, 4 * W * len(layers)),
    )
    name = _SERVER.format(rank - W) if serving else _WORKER.format(rank)
    with _own_store():
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if serving:
        rpc.shutdown()  # serves every request until all workers have shut down
        _TABLES.clear()
        raise SystemExit(0)
    clients = []
    for name, layer in layers:
        client = _Client(name, layer, layer.num_embeddings, rank, S)
        weight = layer._parameters.pop("weight")
        layer.__dict__["_mg_server_meta"] = (weight.dtype, weight.shape[1])
        layer.__dict__["_mg_server"] = client
        forward = _bag_forward if isinstance(layer, nn.EmbeddingBag) else _embedding_forward
        layer.__dict__["forward"] = _bound(forward, client, layer)
        clients.append(client)
    model.__dict__["_mg_param_server"] = _Job(clients, workers, W, S, config, checkpoints)
    atexit.register(shutdown)
    if data_parallel is not None and W > 1:
        _worker_data_parallel(model, data_parallel, workers, W, where)
    return model


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
    checkpoints: Any = None  # the workers' group for resumable's DCP saves and loads


def _worker_data_parallel(model: nn.Module, config: Any, group: Any, W: int, where: str) -> None:
    """GradientSync over the workers only (the default group holds the servers too)."""
    from macrogen.runtime.data_parallel import BufferBroadcast, GradientSync

    sync = GradientSync(model, config, where=where)
    sync.group, sync.world_size, sync.scale = group, W, 1.0 / W
    sync.buffers = BufferBroadcast(group)
    model.__dict__["_mg_gradient_sync"] = sync


@contextlib.contextmanager
def _own_store() -> Any:
    """RPC's rendezvous on a store of its own, hosted by rank 0 on the port it chose. Under
    torchrun (TORCHELASTIC_USE_AGENT_STORE=True) every rank would be a client of a store
    nobody hosts on that port (a hang), and torchrun's own store outlives a restart, where
    a new attempt's RPC keys would meet the killed attempt's."""
    key = "TORCHELASTIC_USE_AGENT_STORE"
    saved = os.environ.pop(key, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[key] = saved


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


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
    """This worker's RPC tensor bytes per server table so far."""
    return {c.key: c.traffic for c in job(model).clients}


def max_lag(model: nn.Module) -> dict[str, int]:
    """Per server table, the most steps any fetch so far lacked of some worker's pushes
    (never above ``staleness``; 0 when synchronous)."""
    from torch.distributed import rpc

    return {
        c.key: max(rpc.rpc_sync(_SERVER.format(j), _lag, args=(c.key,)) for j in range(c.servers))
        for c in job(model).clients
    }


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The server tables, whole, and their optimizer state, after this worker's last step's
    pushes are applied everywhere: ``{path}.weight``, ``{path}.adagrad_sum``, ``{path}.step``.
    Any worker may call it alone (rank 0, to save); with staleness 0 every worker gets the same."""
    from torch.distributed import rpc

    out: dict[str, torch.Tensor] = {}
    for c in job(model).clients:
        c.settle()
        parts = [
            rpc.rpc_sync(_SERVER.format(j), _export, args=(c.key, c.step)) for j in range(c.servers)
        ]
        dtype, dim = c.module.__dict__["_mg_server_meta"]
        rows = torch.empty(c.rows, dim, dtype=dtype)
        for j, (r, _, _) in enumerate(parts):
            rows[j :: c.servers] = r
        out[f"{c.key}.weight"] = rows
        if parts[0][1] is not None:
            total = torch.empty_like(rows)
            for j, (_, s, _) in enumerate(parts):
                total[j :: c.servers] = s
            out[f"{c.key}.adagrad_sum"] = total
        out[f"{c.key}.step"] = torch.tensor(c.step)
    return out


def load_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every worker calls it with the same ``state`` (worker 0 sends the rows to the servers;
    the others wait for that) before the first step: the tables and step counts resume."""
    from torch.distributed import rpc

    j_ = job(model)
    for c in j_.clients:
        c.settle()
        step = int(state[f"{c.key}.step"])
        if dist.get_rank(j_.workers) == 0:
            rows = state[f"{c.key}.weight"]
            total = state.get(f"{c.key}.adagrad_sum")
            for j in range(c.servers):
                part = None if total is None else total[j :: c.servers].contiguous()
                rpc.rpc_sync(
                    _SERVER.format(j),
                    _load,
                    args=(c.key, rows[j :: c.servers].contiguous(), part, step),
                )
        c.step = step
    dist.barrier(group=j_.workers)


def checkpoint_state(model: nn.Module, *, load: bool) -> dict[str, torch.Tensor]:
    """The server tables' part of a ``resumable`` checkpoint (DCP, over the workers' group; the
    servers take no part in it): worker 0 pulls the tables whole with their optimizer state over
    RPC (``state_dict``), every worker adds its step counts (DCP stores one copy of a key). For a
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


_shut = False


def shutdown() -> None:
    """Stop this worker's RPC agent (after every worker's last push): the servers then exit."""
    global _shut
    from torch.distributed import rpc

    if _shut:
        return
    _shut = True
    with contextlib.suppress(Exception):
        rpc.shutdown()
