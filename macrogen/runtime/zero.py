"""Sharded optimizer state (ZeRO stage 1) around any element-wise ``torch.optim`` optimizer.

    opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))

Every rank keeps optimizer state for 1/world of the parameters' elements only:

    flat space (one per dtype and device), parameters in the optimizer's group order:
    | group 0: wte.weight, blocks.0.attn.qkv.weight, ... | group 1: ln.weight, ... | pad |
    |<------- rank 0's chunk ------->|<------- rank 1's chunk ------->|   (chunk = ceil(n / world))

``step()``:

1. each rank's gradients go into one send buffer laid out as the flat space
   (one ``_foreach_copy_``), and one ``reduce_scatter`` leaves each rank the
   sum of its chunk, scaled by 1/world: the averaged gradients of its share;
2. the user's optimizer class, rebuilt over this rank's *pieces* (the parts of
   each parameter in its chunk, 1-D views of one flat tensor), steps them
   with the user's hyperparameters: ``fused=True`` as the user chose, else one
   ``foreach`` (multi-tensor) step over the share;
3. one ``all_gather`` of the chunks and one ``_foreach_copy_`` put the updated
   values back into every parameter.

A piece is an ordinary tensor of the parameter's elements, so any optimizer
whose update is element-wise (SGD, Adam, AdamW, Adagrad, RMSprop, ...) gives
the serial answer, parameter groups and learning-rate schedulers included:
``param_groups`` are the user's, copied into the pieces' groups at each step.
A parameter whose gradient is None on every rank keeps its pieces' gradients
None, so the optimizer skips it as it would serially (one flag per parameter
rides in the same reduce-scatter). ``state_dict()`` is the serial optimizer's
(consolidated: every rank gathers all pieces), and ``load_state_dict`` takes
it, so checkpoints move between serial, data-parallel and sharded runs.

A ``@data_parallel`` model whose parameters this optimizer holds is told not
to average its gradients: the reduce-scatter here does it.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from macrogen.runtime import groups

# Not element-wise: their update of one element depends on others (a closure over the
# whole model, factored row/column statistics, sparse gradients).
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam")


@dataclass
class Piece:
    """The part of one parameter that lies in this rank's chunk."""

    param: torch.nn.Parameter  # the model's parameter
    index: int  # its position in the optimizer's parameter order (the state_dict key)
    group: int  # its parameter group
    start: int  # first element of the piece within the parameter
    stop: int
    at: int  # first element of the piece within the rank's chunk
    tensor: torch.Tensor  # 1-D view into the rank's flat chunk: what the optimizer steps


class Space:
    """One dtype and device: the flat layout, this rank's chunk and its pieces."""

    def __init__(self, params: list[tuple[int, int, torch.nn.Parameter]], world: int, rank: int):
        self.params = [p for _, _, p in params]
        self.offsets: list[int] = []
        at = 0
        for _, _, p in params:
            self.offsets.append(at)
            at += p.numel()
        self.numel = at
        self.world, self.rank = world, rank
        self.chunk = max(1, math.ceil(at / world))
        p0 = self.params[0]
        self.mine = torch.zeros(self.chunk, dtype=p0.dtype, device=p0.device)  # the share
        self.full = torch.zeros(self.chunk * world, dtype=p0.dtype, device=p0.device)
        flags = len(params)  # one "used" flag per parameter after each rank's chunk
        self.send = torch.zeros(world, self.chunk + flags, dtype=p0.dtype, device=p0.device)
        self.recv = torch.zeros(self.chunk + flags, dtype=p0.dtype, device=p0.device)
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        self.pieces: list[Piece] = []
        for (index, group, p), off in zip(params, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                view = self.mine[a - lo : b - lo]
                self.pieces.append(Piece(p, index, group, a - off, b - off, a - lo, view))
        # where each parameter's elements go in the send buffer: (param, start, stop, dst view)
        self.spans: list[tuple[int, int, int, torch.Tensor]] = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            at = off
            while at < off + p.numel():
                r, c = divmod(at, self.chunk)
                stop = min(off + p.numel(), (r + 1) * self.chunk)
                self.spans.append((i, at - off, stop - off, self.send[r, c : c + stop - at]))
                at = stop

    # -- one step's communication ------------------------------------------------------------
    def reduce_scatter(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """This rank's chunk of the averaged gradients; returns each parameter's use count."""
        grads = [p.grad for p in self.params]
        src, dst, empty = [], [], []
        for i, a, b, view in self.spans:
            g = grads[i]
            if g is None:
                empty.append(view)
            else:
                src.append(g.reshape(-1)[a:b])
                dst.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
        if empty:
            torch._foreach_zero_(empty)
        used = torch.tensor([g is not None for g in grads], dtype=self.send.dtype)
        self.send[:, self.chunk :] = used.to(self.send.device)
        dist.reduce_scatter_single(self.recv, self.send.view(-1), group=group)
        self.recv[: self.chunk].mul_(1.0 / self.world)
        return self.recv[self.chunk :]

    def refresh(self) -> None:
        """Copy the parameters' current values into the share (they may have been loaded)."""
        if self.pieces:
            torch._foreach_copy_(
                [pc.tensor for pc in self.pieces],
                [pc.param.detach().reshape(-1)[pc.start : pc.stop] for pc in self.pieces],
            )

    def all_gather(self, group: dist.ProcessGroup | None) -> None:
        """Every rank's updated share into every parameter."""
        dist.all_gather_single(self.full, self.mine, group=group)
        torch._foreach_copy_(
            [p.detach().reshape(-1) for p in self.params],
            [self.full[off : off + p.numel()] for p, off in zip(self.params, self.offsets)],
        )


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer``'s update, with its state sharded over the data-parallel group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
        where: str = "shard_optimizer",
    ):
        kind = type(optimizer)
        if kind.__name__ in NOT_ELEMENTWISE:
            raise TypeError(
                f"{where}: {kind.__name__} does not update each element on its own, so its"
                " state can't be sharded by elements; shard_optimizer supports element-wise"
                " optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ...)"
            )
        self.where = where
        self.inner_class = kind
        self.group = group
        self.world_size = groups.world_size(group)
        self.rank = groups.rank(group)
        saved = optimizer.state_dict() if optimizer.state else None
        super().__init__(optimizer.param_groups, optimizer.defaults)
        order = [p for g in self.param_groups for p in g["params"]]
        by_kind: dict[tuple[torch.dtype, torch.device], list] = defaultdict(list)
        gi = 0
        for g_index, g in enumerate(self.param_groups):
            for p in g["params"]:
                by_kind[(p.dtype, p.device)].append((gi, g_index, p))
                gi += 1
        self.spaces = [Space(ps, self.world_size, self.rank) for ps in by_kind.values()]
        self.pieces = [pc for s in self.spaces for pc in s.pieces]
        # the user's optimizer class over this rank's pieces: one local group per user group
        local_groups = []
        self._local_of: list[int] = []  # local group -> user group
        for g_index, g in enumerate(self.param_groups):
            mine = [pc.tensor for pc in self.pieces if pc.group == g_index]
            if mine:
                local_groups.append({**_settings(g), "params": mine})
                self._local_of.append(g_index)
        # the constructor's own arguments only (AdamW's defaults also hold internal keys)
        accepted = inspect.signature(kind.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self._forced: dict[str, Any] = {}  # settings of the pieces' groups that are ours
        if kwargs.get("foreach", False) is None and not kwargs.get("fused"):
            # left to torch (a per-tensor loop on CPU): one multi-tensor step over the share
            self._forced["foreach"] = kwargs["foreach"] = True
            for g in local_groups:
                g.update(self._forced)
        # None: this rank's chunk holds only padding
        self.local = kind(local_groups, **kwargs) if local_groups else None
        self._disable_gradient_sync(order)
        if saved is not None:
            self.load_state_dict(saved)

    def _disable_gradient_sync(self, params: list[torch.Tensor]) -> None:
        """A @data_parallel model holding these parameters leaves the averaging to us."""
        from macrogen.runtime.data_parallel import syncs_of

        for sync in syncs_of(params):
            if sync.local_sgd is not None:
                raise TypeError(
                    f"{self.where}: shard_optimizer over a @data_parallel(sync_every=k > 1) model"
                    f" ({sync.where}) is not supported: the sharded step averages every step"
                )
            sync.gradients_elsewhere = True

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for space in self.spaces:
            space.refresh()
            used = space.reduce_scatter(self.group)
            unused = {id(space.params[i]) for i in torch.nonzero(used == 0).flatten().tolist()}
            for pc in space.pieces:  # the optimizer skips a piece no rank had a gradient for
                grad = space.recv[pc.at : pc.at + pc.tensor.numel()]
                pc.tensor.grad = None if id(pc.param) in unused else grad
        if self.local is not None:
            for local, user in zip(self.local.param_groups, self._local_of):
                local.update(_settings(self.param_groups[user]), **self._forced)
            self.local.step()
        for space in self.spaces:
            space.all_gather(self.group)
        return loss

    # -- checkpoints: the serial optimizer's format ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The serial optimizer's state_dict (every rank gathers every piece)."""
        mine: list[tuple[int, int, int, int, dict[str, Any]]] = []
        if self.local is not None:
            for pc in self.pieces:
                piece = self.local.state.get(pc.tensor)
                if piece:
                    numel = pc.param.numel()
                    mine.append((pc.index, pc.start, pc.stop, numel, _to_cpu(piece)))
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        params = [p for g in self.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        flat_keys: dict[int, set[str]] = defaultdict(set)
        for pieces in everyone:
            for index, start, stop, numel, piece_state in pieces:
                full = state.setdefault(index, {})
                for key, value in piece_state.items():
                    if _is_elementwise(value, stop - start):
                        if key not in full:
                            full[key] = torch.zeros(numel, dtype=value.dtype)
                            flat_keys[index].add(key)
                        full[key][start:stop] = value.reshape(-1)
                    else:
                        full[key] = value  # replicated in every piece (e.g. Adam's "step")
        for index, keys in flat_keys.items():
            p = params[index]
            for key in keys:  # back to the parameter's shape and device, as serially
                state[index][key] = state[index][key].view(p.shape).to(p.device)
        groups_out = []
        at = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups_out.append({**_settings(g), "params": list(range(at, at + n))})
            at += n
        return {"state": state, "param_groups": groups_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a serial (consolidated) state_dict: each rank keeps its pieces' state."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{self.where}: the state_dict has {len(saved_groups)} parameter groups,"
                f" this optimizer {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, saved_groups):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(f"{self.where}: parameter group sizes differ from the state_dict")
            g.update(_settings(saved))
        # the saved group's parameter ids, in order, are our parameter indices
        ids = [i for g in saved_groups for i in g["params"]]
        saved_state = state_dict["state"]
        if self.local is None:
            return
        self.local.state.clear()
        for pc in self.pieces:
            entry = saved_state.get(ids[pc.index])
            if entry is None:
                continue
            shape = pc.param.shape
            piece_state = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape:
                    flat = value.reshape(-1)[pc.start : pc.stop]
                    piece_state[key] = flat.to(pc.tensor.device, copy=True)
                else:  # replicated (e.g. Adam's "step")
                    piece_state[key] = value.clone() if torch.is_tensor(value) else value
            self.local.state[pc.tensor] = piece_state
        for local, user in zip(self.local.param_groups, self._local_of):
            local.update(_settings(self.param_groups[user]), **self._forced)

    # -- measurement ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.local is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for state in self.local.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _is_elementwise(value: Any, piece_numel: int) -> bool:
    """A state entry with one value per element of the piece (not a replicated scalar)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece_numel


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def shard_optimizer(optimizer: torch.optim.Optimizer, *, where: str = "shard_optimizer"):
    """``optimizer`` sharded over the data-parallel group; itself when the world size is 1."""
    group = groups.data_parallel_group()
    if groups.world_size(group) == 1:
        return optimizer
    return ShardedOptimizer(optimizer, group=group, where=where)
