"""One server table: a server's share of a planned table's rows, their optimizer state, and
the consistency model's bookkeeping (docs/async.md, "Consistency model").

Pure: no communication and no threads. The server's loop (``param_server_wire``) and the
opt-in RPC transport (``param_server_rpc``) ask ``ready`` before they ``read``, so a request
that must wait is kept by them, not by the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ServerConfig:
    servers: int  # S: the last S ranks of the job hold the planned tables
    staleness: int = 0  # steps a worker may run ahead of the slowest push (0: synchronous)
    optimizer: str = "sgd"  # "sgd" or "adagrad" (torch's rules, lr_decay 0, no weight decay)
    lr: float = 0.01
    eps: float = 1e-10  # adagrad
    initial_accumulator_value: float = 0.0  # adagrad
    timeout_s: float = 300.0  # a fetch waiting longer for the other workers' pushes fails
    # "p2p": tensors over the job's process group (the default); "rpc": torch.distributed.rpc,
    # which unpickles what reaches its ports (docs/async.md, "Trust"); None: the environment's
    # MACROGEN_SERVER_TRANSPORT, else "p2p"
    transport: str | None = None


class PushError(RuntimeError):
    """Gradients pushed without the training fetch they belong to."""


class ServerTable:
    """Rows ``j, j + S, j + 2S, ...`` of one table on server j (local index ``r // S``)."""

    def __init__(self, rows: torch.Tensor, config: ServerConfig, workers: int):
        self.rows = rows  # (local rows, dim)
        self.config = config
        self.workers = workers
        adagrad = config.optimizer == "adagrad"
        self.sum = torch.full_like(rows, config.initial_accumulator_value) if adagrad else None
        self.applied = [0] * workers  # pushes applied, per worker
        self.pushed = [0] * workers  # pushes received, per worker (s=0: some may wait)
        self.waiting: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # s=0
        self.fetched: dict[int, torch.Tensor] = {}  # worker -> ids of its last training fetch
        self.max_lag = 0  # the most steps a fetch's rows lacked of some worker's pushes

    # -- when a request may be answered ---------------------------------------------------

    def ready(self, step: int) -> bool:
        """A fetch for a worker's step ``step`` may read the rows now."""
        return min(self.applied) >= step - self.config.staleness

    def settled(self, step: int) -> bool:
        """Every worker's pushes up to ``step`` are applied (an export of step ``step``)."""
        return min(self.applied) >= step

    def missing(self, pushes: int, gone: set[int]) -> int | None:
        """A worker in ``gone`` (it left) whose pushes stop short of ``pushes``: a request that
        needs them would wait forever. None: none."""
        short = [w for w in sorted(gone) if self.pushed[w] < pushes]
        return short[0] if short else None

    # -- the requests ---------------------------------------------------------------------

    def check_ids(self, ids: torch.Tensor) -> str | None:
        """Why ``ids`` cannot index this share (None: they can)."""
        if ids.dim() != 1:
            return f"ids of {ids.dim()} dimensions"
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.rows.shape[0]):
            return f"ids outside 0..{self.rows.shape[0] - 1}"
        return None

    def read(self, worker: int, step: int, ids: torch.Tensor, training: bool) -> torch.Tensor:
        """The rows ``ids`` (local indices) for ``worker``'s step ``step``; call when ready."""
        ids = ids.long()
        self.max_lag = max(self.max_lag, step - min(self.applied))
        if training:
            self.fetched[worker] = ids
        return self.rows.index_select(0, ids)

    def push(self, worker: int, step: int, grads: torch.Tensor) -> None:
        ids = self.fetched.pop(worker, None)
        if ids is None or ids.numel() != grads.shape[0]:
            raise PushError(
                f"parameter server: worker {worker} pushed gradients for step {step} without"
                " a matching training fetch (one training forward per table per step)"
            )
        self.pushed[worker] += 1
        if self.config.staleness > 0:
            self._apply(ids, grads)
            self.applied[worker] += 1
            return
        self.waiting.setdefault(step, {})[worker] = (ids, grads)
        if len(self.waiting[step]) == self.workers:
            by_worker = self.waiting.pop(step)
            order = range(self.workers)  # worker order: the same sum on every run
            self._apply(
                torch.cat([by_worker[w][0] for w in order]),
                torch.cat([by_worker[w][1] for w in order]),
            )
            self.applied = [step + 1] * self.workers

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

    def export(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows and Adagrad sums as they are (call when ``settled``)."""
        return self.rows.clone(), None if self.sum is None else self.sum.clone()

    def load(self, rows: torch.Tensor, sum_: torch.Tensor | None, step: int) -> None:
        self.rows.copy_(rows)
        if self.sum is not None and sum_ is not None:
            self.sum.copy_(sum_)
        self.applied = [step] * self.workers
        self.pushed = [step] * self.workers
        self.waiting.clear()
        self.fetched.clear()
