"""A pipelined model's state dict as the serial model's: every stage's entries, gathered.

Each rank holds its stages' parts only, at their own keys (the serial names). The full
state dict gathers the stages' entries over the pipeline group, whole (a tensor-parallel
shard gathered in its stage, a DTensor made full), in the serial model's key order;
loading one gives each stage its own entries (a DTensor its shard).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def gathered(
    model: nn.Module, keys: list[str], tensor_parallel: bool, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """The serial model's state dict, in ``keys``' order, from every stage of ``group``
    (None: one rank holds the whole model)."""
    local = _local(model, tensor_parallel)
    if group is None:
        return local
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in local.items()}, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    return {k: merged[k] for k in keys if k in merged}


def load(
    model: nn.Module,
    keys: list[str],
    state_dict: dict[str, torch.Tensor],
    tensor_parallel: bool,
    strict: bool,
    where: str,
) -> Any:
    """Load a serial model's state dict into this rank's stages (each keeps its entries)."""
    if strict:
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if missing or unexpected:
            raise RuntimeError(
                f"{where}not a state dict of this model: missing {missing}, unexpected {unexpected}"
            )
    current = model.state_dict()
    mine = {k: v for k, v in state_dict.items() if k in current}
    # DTensors (FSDP's, mg.parallelize's tensor-parallel ones): this rank's shard of each
    # (FSDP's shard of a packed colwise shard cut by hand: torch permutes its rows)
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.dtensor_whole import restride

    for k, v in mine.items():
        now = current[k]
        if isinstance(now, DTensor):
            mine[k] = restride(v.to(now.device, now.dtype), now)
    if tensor_parallel:  # each keeps its @tensor_parallel shard
        from macrogen.runtime.tensor_parallel import load_full_state_dict

        return load_full_state_dict(model, mine, strict=strict)
    return model.load_state_dict(mine, strict=strict)


def _local(model: nn.Module, tensor_parallel: bool) -> dict[str, torch.Tensor]:
    """This stage's entries at serial shapes (tensor-parallel shards gathered in the stage)."""
    if tensor_parallel:
        from macrogen.runtime.tensor_parallel import full_state_dict

        state = full_state_dict(model)  # @tensor_parallel's shards
    else:
        state = model.state_dict()
    # DTensors (FSDP's, mg.parallelize's tensor-parallel ones): every rank of the stage
    # gathers each, in the same order (FSDP's shard of a packed colwise shard by hand)
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.dtensor_whole import full_tensor

    return {k: full_tensor(v) if isinstance(v, DTensor) else v for k, v in state.items()}
