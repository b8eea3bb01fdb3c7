"""The model's repeated blocks: the unit that FSDP shards, recompute checkpoints, the
pipeline cuts between, and the tensor-parallel swap runs per under data parallel."""

from __future__ import annotations

import torch.nn as nn


def repeated_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of the model's repeated layer list: the ModuleList of one class (2 or more
    entries) holding the most parameters; [] when there is none."""
    best: list[tuple[str, nn.Module]] = []
    best_size = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            prefix = f"{name}." if name else ""
            best, best_size = [(f"{prefix}{i}", child) for i, child in enumerate(module)], size
    return best
