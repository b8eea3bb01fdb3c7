"""Which of a sharded optimizer's parameters are tensor-parallel shards, for exact norms.

Over a tensor-parallel model (``mg.parallelize(tp=..., dp="zero1")``, ``@tensor_parallel``
with ``mg.shard_optimizer``) each parameter is a DTensor, and ZeRO-1 divides each tensor
rank's local tensor over the data ranks. A norm of the averaged gradients then has two
kinds of parts:

    colwise weight  Shard(0): tensor rank t holds rows t      -> sum the parts over the tensor group
    layer norm      Replicate(): every tensor rank holds all  -> count once (already whole)

``TensorShards`` names, for each parameter of the optimizer's order, the groups its
elements are split over (the mesh dims where its placement is not ``Replicate``: ``Shard``, a packed layer's strided shard, from the DTensor's own
``device_mesh``), so that a norm's per-parameter parts, once summed over the data group,
are summed over those groups too: the serial model's norm, each element counted once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class TensorShards:
    """The optimizer's parameters split over a tensor group (by their DTensor placements)."""

    def __init__(self, params: list[torch.Tensor]):
        by_group: dict[dist.ProcessGroup, list[int]] = {}
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue  # a plain tensor is whole on every tensor rank
            names = p.device_mesh.mesh_dim_names or ()
            for dim, placement in enumerate(p.placements):
                # ep's experts: their buckets are cut over their replicas, so the data group's
                # sum counts each element once (zero_experts); not summed again over "ep"
                if dim < len(names) and names[dim] == "ep":
                    continue
                # split (Shard, or the _StridedShard of a packed colwise layer): not whole
                if not placement.is_replicate():
                    by_group.setdefault(p.device_mesh.get_group(dim), []).append(i)
        # (group, indices of the parameters split over it), in first-seen order: every rank
        # of a tensor group holds the same parameters, so issues the same collectives
        self.groups = [(g, torch.tensor(idx)) for g, idx in by_group.items()]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def sum_parts(self, parts: torch.Tensor, p: float) -> None:
        """``parts[i]`` (parameter i's part of a p-norm on this tensor rank: sum of |g|^p, or
        the largest |g| for p = inf), summed (max) over the groups parameter i is split over;
        in place, one all-reduce per group."""
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
        for group, index in self.groups:
            index = index.to(parts.device)
            split = parts.index_select(0, index)
            dist.all_reduce(split, op=op, group=group)
            parts.index_copy_(0, index, split)
