"""``mg.clip_grad_norm_``: the serial program's gradient clipping on every layout.

torch's ``clip_grad_norm_`` takes one total norm over gradients it stacks together. That is
the serial norm for plain tensors and for DTensors on one mesh, but two cases need more:

- ``mg.shard_optimizer``'s optimizer holds only this rank's share of the averaged gradients
  (its own ``clip_grad_norm_`` sums the shares' norms over the data ranks);
- gradients on several meshes (expert parallelism under FSDP: the experts' on the (replica x
  expert) grid, the rest's on the data mesh): torch's one ``torch.stack`` of DTensors on two
  meshes raises. Here each mesh's gradients give their norm (a whole-tensor value, every rank
  the same), the norms are combined in ``norm_type`` as one norm over all of them would be,
  and each mesh's gradients are scaled by torch's coefficient from that total;
- the largest-value norm (``inf``) of DTensor gradients: torch's raises on a rank whose FSDP
  shard is empty, and came out below the serial norm on the (replica, expert, tensor) mesh of
  tp x ep with whole experts on each tensor rank (0.149 for 0.206, measured). Here it is each
  rank's own largest value, then the largest over every dim of the mesh, for every DTensor
  gradient, one mesh or several.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: torch.optim.Optimizer | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of an optimizer's (or of these) parameters as the serial program would,
    and return the serial total norm: torch's signature, sharded optimizers and mixed meshes
    included."""
    from macrogen.runtime.zero import ShardedOptimizer

    if isinstance(parameters, ShardedOptimizer):
        return parameters.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(parameters, torch.optim.Optimizer):
        params = [p for g in parameters.param_groups for p in g["params"]]
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
    groups = _by_mesh(params)
    if list(groups) in ([], [None]):  # plain tensors: torch's own
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )
    norms = [_norm(ps, mesh, norm_type, foreach) for mesh, ps in groups.items()]
    device = norms[0].device
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack([n.to(device) for n in norms]), norm_type
    )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite,"
            " so it cannot be clipped. To disable this error and scale the gradients by the"
            " non-finite norm anyway, set `error_if_nonfinite=False`"
        )  # (torch's message)
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach)
    return total


def _by_mesh(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The parameters with a gradient, grouped by the mesh it lives on (None: plain tensors)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return groups


def _norm(
    ps: list[torch.Tensor], mesh: Any, norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """The norm of ``ps``' gradients as a plain tensor, the same on every rank of ``mesh``."""
    grads = [p.grad for p in ps if p.grad is not None]
    if mesh is None:
        return torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if norm_type == float("inf"):  # torch's raises on a rank whose FSDP shard is empty
        return _max_norm(grads, mesh)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    whole: torch.Tensor = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return whole


def _max_norm(grads: list[Any], mesh: Any) -> torch.Tensor:
    """The largest absolute value of DTensor gradients: each rank's own, then the largest over
    every dim of their mesh (right for shards and replicas alike)."""
    locals_ = [g.to_local() for g in grads]
    device = locals_[0].device
    mine = [t.abs().max() for t in locals_ if t.numel()]
    top = (
        torch.stack(mine).max() if mine else torch.zeros((), dtype=locals_[0].dtype, device=device)
    )
    for dim in range(mesh.ndim):
        dist.all_reduce(top, dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return top
