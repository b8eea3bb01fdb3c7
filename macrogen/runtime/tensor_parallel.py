"""A tensor-parallel model's state as the serial model's: its DTensor parameters gathered whole,
and a serial state dict cut into them.

``@tensor_parallel`` classes get ``full_state_dict`` / ``load_full_state_dict`` methods
(``class_plans``), and a pipeline gathers its stages through them (``pipeline_state``). The
parameters are DTensors (``macrogen.runtime.parallelize.apply_tensor_parallel``), so this is
``full_tensor()`` on the way out and each rank's piece of the serial tensor on the way in,
through ``dtensor_whole`` (packed colwise layers' strided shards, FSDP over TP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from macrogen.runtime.dtensor_whole import full_tensor, restride


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A copy at the serial shape (a replicated DTensor's full_tensor() is its own storage)."""
    whole = full_tensor(t) if isinstance(t, DTensor) else t
    return whole.detach().clone()


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state dict (same keys, same shapes), gathered on every rank."""
    return {k: _whole(v) for k, v in module.state_dict().items()}


def full_gradients(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient at full (serial) shape, by parameter name, on every rank."""
    return {k: None if p.grad is None else _whole(p.grad) for k, p in module.named_parameters()}


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """Load a serial model's state dict: every rank keeps its piece of each DTensor parameter."""
    current = module.state_dict()
    local: dict[str, Any] = dict(state_dict)
    for key, value in local.items():
        now = current.get(key)
        if isinstance(now, DTensor) and not isinstance(value, DTensor):
            local[key] = restride(value.to(now.device, now.dtype), now)
    return module.load_state_dict(local, strict=strict)


def serial_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``full_state_dict`` under the name generated code calls (a method calling a function
    of the same name would read as recursion)."""
    return full_state_dict(module)


def load_serial_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> Any:
    """``load_full_state_dict`` under the name generated code calls."""
    return load_full_state_dict(module, state_dict, strict)
