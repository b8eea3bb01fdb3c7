"""Activation recomputation of a built model's repeated blocks: ``mg.parallelize(recompute="blocks")``.

Each block of the model's repeated layer list (``fully_sharded.repeated_layers``:
the ModuleList of one class that holds the most parameters) keeps only its
input for backward and runs its forward again there, under torch's
non-reentrant ``torch.utils.checkpoint`` (random ops replay the same numbers:
the RNG state is kept). The block's class is untouched: ``forward`` becomes an
instance attribute around the block's own, as a planned layer's forward does
under tensor parallelism, so that ``state_dict`` keys, ``isinstance`` and the
module tree stay the serial model's (``checkpoint_wrapper`` would rename every
key). It is applied after tensor parallelism and before data parallel, in
torchtitan's order: FSDP's hooks run around the recomputed forward, and a
tensor-parallel block's collectives run again in its recompute.

Activations fall from every block's to the blocks' inputs plus one block's; a
step costs one more forward of the blocks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from macrogen.runtime.fully_sharded import repeated_layers
from macrogen.runtime.parallelize import local_parameters

CHOICES = (None, "none", "blocks")


def apply_recompute(model: nn.Module, which: str | None, *, where: str) -> nn.Module:
    """Recompute ``model``'s repeated blocks in backward (``which="blocks"``); None/"none": keep."""
    if which not in CHOICES:
        raise ValueError(
            f"mg.parallelize at {where}: recompute={which!r}: expected None, 'none' or 'blocks'"
        )
    if which in (None, "none"):
        return model
    blocks = repeated_layers(model)
    if not blocks:
        raise ValueError(
            f"mg.parallelize at {where}: recompute='blocks' found no repeated blocks (a"
            f" ModuleList of one class, 2 or more entries) in {type(model).__name__}"
        )
    for _, block in blocks:
        if getattr(block.forward, "_mg_recomputed", False):
            continue  # applied once: a second mg.parallelize keeps one checkpoint
        block.forward = _recomputed(block)
    return model


def _recomputed(block: nn.Module) -> Callable[..., Any]:
    # The block holds this function: it reaches the block weakly, or a block that a pipeline
    # cut drops (another stage's) would live on in a reference cycle until a gc pass.
    ref = weakref.ref(block)
    own = block.__dict__.get("forward")  # an instance forward already there, else the class's

    def forward(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        assert me is not None, "a block's forward outlived its block"
        return own(*args, **kwargs) if own is not None else type(me).forward(me, *args, **kwargs)

    def again(*args: Any, **kwargs: Any) -> Any:
        # the recompute runs in backward, after mg.parallelize's forward hook has put the
        # tensor-parallel DTensor parameters back: the block takes its local shards again
        me = ref()
        assert me is not None, "a block's forward outlived its block"
        with local_parameters(me):
            return forward(*args, **kwargs)

    @functools.wraps(type(block).forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            return forward(*args, **kwargs)
        return checkpoint(again, *args, use_reentrant=False, **kwargs)

    run._mg_recomputed = True  # type: ignore[attr-defined]
    return run
