"""A DTensor whole, and cut again: FSDP x TP tensors that torch's own calls permute.

With a packed colwise layer under FSDP x TP, a parameter's placements are two nested
strided shards, and torch 2.13's ``full_tensor()`` and ``redistribute`` come out with
their rows permuted. ``full_tensor`` gathers such a tensor one mesh dim at a time and
``restride`` cuts a whole tensor back into the template's shard. Checkpoints
(``checkpoint_state``) and a pipeline's full state dict (``pipeline``) use both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def restride(whole: torch.Tensor, template: DTensor) -> DTensor:
    from torch.distributed.tensor import Replicate

    mesh = template.device_mesh
    if _fsdp_over_tp(template):  # the tensor dim as for TP alone, then FSDP's chunk of it
        tensor_mesh = _tensor_mesh(template)
        replicated = DTensor.from_local(whole, tensor_mesh, [Replicate()], run_check=False)
        tp_local = replicated.redistribute(tensor_mesh, [template.placements[1]]).to_local()
        chunks = torch.chunk(tp_local, mesh.size(0), dim=_dim(template.placements[0]) or 0)
        rank = mesh.get_local_rank(0)
        mine = chunks[rank] if rank < len(chunks) else template.to_local().new_empty(0)
        return DTensor.from_local(
            mine.reshape(template.to_local().shape).contiguous(),
            mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
            run_check=False,
        )
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, template.placements)


# ---- FSDP x TP: a tensor-parallel DTensor FSDP sharded over the data dim -------------------


def _dim(placement: Any) -> int | None:
    """The tensor dim a placement shards (Shard, _StridedShard); None for any other."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def _fsdp_over_tp(value: DTensor) -> bool:
    """A (data, tensor) DTensor, FSDP's shard of a tensor-parallel local tensor. With a packed
    colwise layer its placements are two nested strided shards, whose ``full_tensor()`` and
    ``redistribute`` come out permuted (torch 2.13): such a tensor is gathered and split one
    mesh dim at a time, FSDP's dim by hand (``torch.chunk``, as FSDP2 cuts it), the tensor dim
    as for TP alone."""
    mesh = value.device_mesh
    return (
        mesh.ndim == 2 and mesh.mesh_dim_names is not None and _dim(value.placements[0]) is not None
    )


def _tensor_mesh(value: DTensor) -> Any:
    mesh = value.device_mesh
    names = mesh.mesh_dim_names
    assert names is not None  # (_fsdp_over_tp)
    return mesh[names[1]]


def full_tensor(value: DTensor) -> torch.Tensor:
    if not _fsdp_over_tp(value):
        return value.full_tensor()
    mesh = value.device_mesh
    dim = _dim(value.placements[0])
    assert dim is not None  # (_fsdp_over_tp)
    pieces = _all_gather_uneven(value.to_local().contiguous(), dim, mesh.get_group(0))
    tp = DTensor.from_local(
        torch.cat(pieces, dim),
        _tensor_mesh(value),
        [value.placements[1]],
        shape=value.shape,
        stride=value.stride(),
        run_check=False,
    )
    return tp.full_tensor()


def _all_gather_uneven(local: torch.Tensor, dim: int, group: Any) -> list[torch.Tensor]:
    """Every rank's ``local`` (their sizes along ``dim`` may differ: torch.chunk's last ones)."""
    size = torch.tensor([local.shape[dim]], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    shape = list(local.shape)
    shape[dim] = longest
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [g.narrow(dim, 0, int(s.item())) for g, s in zip(gathered, sizes)]
