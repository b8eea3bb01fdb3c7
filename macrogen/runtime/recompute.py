"""Activation recomputation of a built model's repeated blocks: ``mg.parallelize(recompute="blocks")``.

Each block of the model's repeated layer list (``blocks.repeated_layers``:
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

``recompute=N`` (an int >= 1) recomputes every N-th block, those at indices 0, N, 2N, ...
of the list (torchtitan's "selective" layer mode, ``ac_freq``); 1 is "blocks".

Activations fall from every block's to the recomputed blocks' inputs, the others'
own, plus one block's; a step costs one more forward of the recomputed blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from macrogen.runtime.blocks import repeated_layers
from macrogen.runtime.parallelize.local import local_parameters, weakly_bound


def every(which: object) -> int | None:
    """Every how many blocks ``recompute=which`` recomputes (0: none); None for a bad value."""
    if which in (None, "none"):
        return 0
    if which == "blocks":
        return 1
    if isinstance(which, int) and not isinstance(which, bool) and which >= 1:
        return which
    return None


def apply_recompute(model: nn.Module, which: str | int | None, *, where: str) -> nn.Module:
    """Recompute ``model``'s repeated blocks in backward: all (``which="blocks"`` or 1), every
    N-th (an int N), or none (None/"none")."""
    n = every(which)
    if n is None:
        raise ValueError(
            f"mg.parallelize at {where}: recompute={which!r}: expected None, 'none', 'blocks'"
            " or an int N >= 1 (every N-th block)"
        )
    if n == 0:
        return model
    blocks = repeated_layers(model)
    if not blocks:
        raise ValueError(
            f"mg.parallelize at {where}: recompute={which!r} found no repeated blocks (a"
            f" ModuleList of one class, 2 or more entries) in {type(model).__name__}"
        )
    for i, (_, block) in enumerate(blocks):
        if i % n:
            continue  # kept whole: its activations stay for backward
        if getattr(block.forward, "_mg_recomputed", False):
            continue  # applied once: a second mg.parallelize keeps one checkpoint
        block.forward = _recomputed(block)
    return model


def _recomputed(block: nn.Module) -> Callable[..., Any]:
    # The block holds these functions: they reach it weakly (weakly_bound), or a block that a
    # pipeline cut drops (another stage's) would live on in a reference cycle until a gc pass.
    own = block.__dict__.get("forward")  # an instance forward already there, else the class's
    forward = own if own is not None else weakly_bound(type(block).forward, block)

    def local(me: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # the recompute runs in backward, after mg.parallelize's forward hook has put the
        # tensor-parallel DTensor parameters back: the block takes its local shards again
        with local_parameters(me):
            return forward(*args, **kwargs)

    again = weakly_bound(local, block)

    @functools.wraps(type(block).forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            return forward(*args, **kwargs)
        return checkpoint(again, *args, use_reentrant=False, **kwargs)

    run._mg_recomputed = True  # type: ignore[attr-defined]
    return run
