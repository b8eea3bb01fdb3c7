"""The sequence-parallel styles (Megatron-SP, torch's ``SequenceParallel`` with ``Shard(1)``
layouts): between them each rank holds its slice of the sequence, ``(B, T / tp, C)``, so the
activations of the per-token modules in between (layer norms, dropout, residual adds) are
1 / tp of serial per rank.

    style                  before the module's forward              after it
    colwise_from_sequence  the slices all-gathered along T          the output is this rank's
                           (its gradient reduce-scattered)          slice of the features
    rowwise_to_sequence    a whole input split (keep my slice)      partial sums reduce-scattered
                                                                    along T (the bias added once)
    from_sequence          the first input's slices gathered        -
    sequence_slice         -                                        -  (its parameters' gradients
                                                                       summed: ``layout.SUMS``)

The two linear styles compute with the fused layers of ``macrogen.runtime.collectives_sequence``; the
layout takes them only for a layer whose forward is ``nn.Linear``'s or HF ``Conv1D``'s. Each
forward is ``forward(module, spec, x, ...)`` with ``spec`` a ``styles.Wrapped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from macrogen.runtime.collectives import scatter_last_dim
from macrogen.runtime.collectives_sequence import (
    colwise_from_sequence,
    gather_sequence,
    rowwise_to_sequence,
)
from macrogen.runtime.parallelize.local import local_parameters

# the linear styles and the plain style they cut like
LINEAR = {"colwise_from_sequence": "colwise", "rowwise_to_sequence": "rowwise"}
WRAPPED = (*LINEAR, "from_sequence")


def _local(module: nn.Module, kind: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight as F.linear's (out, in), bias): local tensors (inside the model's forward they
    are already; a layer called on its own swaps them)."""
    with local_parameters(module):
        w: torch.Tensor = module.weight  # type: ignore[assignment]
        bias = module._parameters.get("bias")
    return (w.t() if kind == "conv1d" else w), bias


def _colwise_from_sequence(me: nn.Module, s: Any, x: torch.Tensor) -> torch.Tensor:
    weight, bias = _local(me, s.kind)
    return colwise_from_sequence(x, weight, bias, s.group)


def _rowwise_to_sequence(me: nn.Module, s: Any, x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == s.width:  # a whole input: keep my slice
        x = scatter_last_dim(x, s.group)
    weight, bias = _local(me, s.kind)
    return rowwise_to_sequence(x, weight, bias, s.group, s.name)


def _from_sequence(me: nn.Module, s: Any, *args: Any, **kwargs: Any) -> Any:
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError(
            f"{type(me).__name__} planned from_sequence: its first positional input must be the"
            " tensor to gather"
        )
    return s.own(me, gather_sequence(args[0], s.group), *args[1:], **kwargs)


FORWARDS: dict[str, Callable[..., Any]] = {
    "colwise_from_sequence": _colwise_from_sequence,
    "rowwise_to_sequence": _rowwise_to_sequence,
    "from_sequence": _from_sequence,
}


def linear_problem(name: str, module: nn.Module, kind: str | None, style: str) -> str | None:
    """Why ``module`` can't take a sequence linear style (its forward must be the plain one)."""
    plain = (kind == "linear" and type(module).forward is nn.Linear.forward) or kind == "conv1d"
    if plain and "forward" not in module.__dict__:
        return None
    return (
        f"{name}: {style} takes an nn.Linear (or HF Conv1D) whose forward is nn.Linear's, not"
        f" {type(module).__name__} with its own forward (plan it {LINEAR[style]!r} and leave the"
        " sequence whole)"
    )


def slice_problem(name: str, module: nn.Module, kind: str | None) -> str | None:
    """Why ``module`` can't run on a slice of the sequence (it mixes tokens, or is a TP layer)."""
    if kind is None and not isinstance(module, _NOT_PER_TOKEN):
        return None
    return (
        f"{name}: sequence_slice runs a per-token module (a layer norm, dropout) on this rank's"
        f" slice of the sequence, not {type(module).__name__} (nn.LayerNorm, nn.RMSNorm,"
        " nn.Dropout or a per-token module of yours)"
    )


# torch layers that mix tokens or are tensor-parallel layers of their own
_NOT_PER_TOKEN = (nn.Linear, nn.Embedding, nn.MultiheadAttention, nn.Conv1d, nn.RNNBase)
