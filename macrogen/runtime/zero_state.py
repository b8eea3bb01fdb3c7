"""A ``ShardedOptimizer``'s state in the serial optimizer's format, and back.

Each rank holds the optimizer state of its pieces (as flat runs, ``zero_runs``).
``consolidated`` gathers every rank's pieces (``all_gather_object``: call it on
every rank) into the state_dict the serial optimizer would have, each
element-wise entry (Adam's moments) whole and in its parameter's shape, each
per-tensor entry (Adam's ``step``) as the pieces hold it; ``load`` gives each
rank its pieces' slices of such a state_dict. So checkpoints move between
serial, data-parallel and sharded runs.

Over a tensor-parallel model each rank's pieces are of its tensor rank's local
tensor: an element-wise entry of a DTensor parameter is gathered over the data
ranks into that local tensor and handed out as a DTensor with the parameter's
mesh and placements, as torch's own optimizer over the DTensor parameter holds
it (so DCP saves every tensor rank's part once); ``load`` takes such a DTensor
by its local tensor, and a serial (whole) tensor by the part the parameter's
placements give this rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from macrogen.runtime import zero_runs
from macrogen.runtime.zero_buckets import elements

if TYPE_CHECKING:
    from macrogen.runtime.zero_buckets import Piece
    from macrogen.runtime.zero_experts import ExpertCut
    from macrogen.runtime.zero_runs import Run


def settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters (all but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def consolidated(
    runs: list[Run],
    local: torch.optim.Optimizer | None,
    param_groups: list[dict[str, Any]],
    world_size: int,
    group: dist.ProcessGroup | None,
    experts: ExpertCut | None = None,
) -> dict[str, Any]:
    """The serial optimizer's state_dict of the user's ``param_groups``, from every rank's
    ``local`` optimizer over its ``runs`` (None: this rank's chunks hold only padding). With
    ``experts`` (ep), an expert's pieces come from the ranks holding this rank's experts."""
    position = experts.position if experts is not None else 0
    mine: list[tuple[int, int, int, int, dict[str, Any], int]] = []
    if local is not None:
        for pc, piece in _piece_states(runs, local):
            if piece:
                numel = elements(pc.param).numel()
                mine.append((pc.index, pc.start, pc.stop, numel, _to_cpu(piece), position))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    params = [p for g in param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    flat_keys: dict[int, set[str]] = defaultdict(set)
    for pieces in everyone:
        for index, start, stop, numel, piece_state, held_at in pieces:
            if experts is not None and index in experts.experts and held_at != position:
                continue  # another expert group position's experts
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
        held = elements(p)
        for key in keys:  # back to the parameter's shape and device, as serially
            value = state[index][key].view(held.shape).to(held.device)
            state[index][key] = _like(value, p)
    groups_out = []
    at = 0
    for g in param_groups:
        n = len(g["params"])
        groups_out.append({**settings(g), "params": list(range(at, at + n))})
        at += n
    return {"state": state, "param_groups": groups_out}


def load(
    runs: list[Run], local: torch.optim.Optimizer, saved: dict[Any, Any], ids: list[Any]
) -> None:
    """Give ``local`` its pieces' slices of a serial state_dict's ``state`` (``saved``);
    ``ids[i]``: the state_dict's key of the optimizer's i-th parameter."""
    local.state.clear()
    for run in runs:
        states: list[dict[str, Any] | None] = []
        for pc in run.pieces:
            entry = saved.get(ids[pc.index])
            if entry is None:
                states.append(None)
                continue
            shape = elements(pc.param).shape  # (a DTensor's: its local tensor's)
            piece_state = {}
            for key, value in entry.items():
                value = _held_part(value, pc.param)
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape:
                    flat = value.reshape(-1)[pc.start : pc.stop]
                    piece_state[key] = flat.to(pc.tensor.device, copy=True)
                else:  # replicated (e.g. Adam's "step")
                    piece_state[key] = value.clone() if torch.is_tensor(value) else value
            states.append(piece_state)
        zero_runs.load_run(run, local, states)


def _piece_states(
    runs: list[Run], local: torch.optim.Optimizer
) -> list[tuple[Piece, dict[str, Any] | None]]:
    """Each piece's optimizer state (its slice of a flat run's)."""
    out: list[tuple[Piece, dict[str, Any] | None]] = []
    for run in runs:
        state = local.state.get(run.tensor) if run.flat else None
        for pc in run.pieces:
            if run.flat:
                piece = zero_runs.piece_state(run, pc, state, view=True) if state else None
            else:
                piece = local.state.get(pc.tensor)
            out.append((pc, piece))
    return out


def _is_elementwise(value: Any, piece_numel: int) -> bool:
    """A state entry with one value per element of the piece (not a replicated scalar)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece_numel


def _held_part(value: Any, p: torch.Tensor) -> Any:
    """The part of a state entry this rank's pieces of ``p`` come from: a DTensor's local
    tensor; for a DTensor parameter, a whole (serial) tensor of its shape cut as ``p`` is
    (each rank its own part, no communication); anything else as it is."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(p, DTensor) and torch.is_tensor(value) and value.shape == p.shape:
        local = elements(p)
        whole = value.to(device=local.device, dtype=value.dtype)
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return value


def _like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (the local tensor's state) as a DTensor like ``p`` when ``p`` is one."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
