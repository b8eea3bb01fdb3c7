"""``mg.parallelize(model, tp=T, ep=E, tp_plan=...)``: experts dealt over E data ranks, each
expert cut over the T tensor ranks inside.

The world is D data ranks x T tensor ranks (``mesh``: rank = data rank x T + tensor rank).
The data ranks form the (replica x expert) grid as with tp=1, once per tensor rank, so the
experts' mesh is ``("ep_replicate", "ep", "tensor")``, shape (D / E, E, T):

- tensor parallelism is applied first, as without ep: the plan (transformers' ``moe_tp_experts``
  or a hand plan) cuts every expert's 3-D parameters on a hidden dim (``gate_up_proj``
  packed colwise, ``down_proj`` rowwise) and wraps the experts module (``moe_experts``): its
  inputs copied to the tensor group (their gradients summed there), its output all-reduced;
- expert parallelism then keeps this data rank's experts of each tensor cut: placements
  ``(Replicate(), Shard(0), <the cut>)`` on the grid, and routes inside the tensor-parallel
  wrapper. Every tensor rank of a data rank holds the same tokens and the same (replicated)
  router, so it picks the same experts: each tensor rank routes on its own, over the expert
  group of its tensor rank, and the experts compute their partial sums on the rows they
  receive. Routing on one tensor rank and sharing with the others would move the same rows
  over the tensor group again, one step later. The partial outputs come back by the reverse
  all-to-all and are weighted and summed per token; the wrapper's all-reduce then sums them
  over the tensor group once, on (tokens, hidden): before the combine it would be (tokens x
  top_k, hidden).
- every other parameter keeps its tensor-parallel placement, on the grid
  (``(Replicate(), Replicate(), <placement>)``): one mesh for ``clip_grad_norm_``, and
  ``numel`` and ``state_dict`` see the serial model. Data parallel averages those gradients over
  the D data ranks of each tensor rank, as without ep; the experts' gradients are summed over
  their replica group of their tensor rank and divided by D (``expert_parallel``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from macrogen.runtime.parallelize.engine import onto_mesh
from macrogen.runtime.parallelize.local import attach, detach


def tensor_problem(
    found: list[tuple[str, nn.Module]], lists: list[tuple[str, nn.Module]], dp: str
) -> str | None:
    """Why ep cannot run with tp > 1 on these experts, or None."""
    if dp != "replicate":
        return (
            f'dp={dp!r} is not supported yet: ep with tp > 1 runs with dp="replicate" (ep with'
            ' dp="fsdp": tp=1)'
        )
    if lists:
        return (
            f"{lists[0][0]}: ep over an nn.ModuleList of experts runs with tp=1 (stack the"
            " experts into one experts module for tp inside them)"
        )
    for name, module in found:
        for key, p in module.named_parameters(recurse=False):
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.is_meta:
                return (
                    f"{name}.{key}: a model built on the meta device (init=) is not supported"
                    " yet with tp > 1: build the model with its values"
                )
            cut = p.placements[0] if isinstance(p, DTensor) else None
            if isinstance(cut, Shard) and cut.dim == 0:
                return (
                    f"{name}.{key}: the tensor-parallel plan deals whole experts over the tensor"
                    " ranks (shard_experts; transformers' grouped_gemm), and ep deals them over"
                    " the data ranks: cut the experts inside (gate_up_proj ('colwise', 2),"
                    " down_proj 'rowwise', the experts module 'moe_experts': tp_plan='hf'), or"
                    " leave them out of the plan"
                )
    return None


def tensor_cut(p: torch.Tensor, grid: Any) -> tuple[torch.Tensor, list[Any]]:
    """An experts parameter's tensor rank's part (every expert) and its placement on the grid's
    tensor dim ([] without one): tensor parallelism's cut, else the whole parameter."""
    if isinstance(p, DTensor):  # on the tensor dim's mesh (apply_tensor_parallel)
        return p.to_local().detach(), list(p.placements)
    return p.detach(), [Replicate()] if grid.ndim == 3 else []


def rest_onto_grid(model: nn.Module, scope: list[nn.Module], grid: Any) -> None:
    """Every parameter of ``scope`` (the model but its experts) as a DTensor on the grid with
    its tensor-parallel placement (replicated over the data dims; tied parameters stay tied,
    the local tensors are the same), and the model's swap to local tensors over ``scope``
    alone: the experts swap their own (``expert_parallel``: their gradients' reduction)."""

    def place(p: nn.Parameter) -> tuple[torch.Tensor, list[Any]]:
        local, cut = tensor_cut(p, grid)
        return local, [Replicate(), Replicate(), *cut]

    onto_mesh(scope, grid, place)
    before = detach(model)  # tensor parallel's swap, its first-backward checks kept
    if before is None:
        attach(model, scope, None)
    else:
        attach(model, scope, before.check, before.watch)
