"""What autograd saves for backward during a probe's step, and the share tensor parallelism splits.

The probe (``probe.py``) runs one step of the model under these hooks; ``memory.py``
scales the activations by the share in the blocks (what recomputing them frees) and by
the share a tensor-parallel plan shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


class SavedActivations:
    """The bytes autograd saves for backward, and the share a tensor-parallel plan shards.

    A saved tensor is sharded when it is a colwise layer's output or a rowwise layer's
    input (or a view of one: the attention's q, k, v and its output before the
    projection), when its last dim is a width the plan cuts other than the residual
    stream's (the MLP's hidden side), or, 4-d, when its dim 1 is a head count the plan
    divides ((B, heads, T, .): attention). The residual stream, the norms and what feeds
    a colwise layer are whole on every tensor rank: Megatron's activations are only partly
    sharded. (A width rule alone counted the residual as split when an attention's
    projections are as wide as it: tensor parallelism's memory was 31% under.)
    """

    def __init__(
        self,
        model: Any,
        divisible: Mapping[str, int],
        blocks: list[Any],
        planned: Mapping[str, list[Any]] | None = None,
    ):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.blocks = blocks
        self.planned = planned or {"colwise": [], "rowwise": []}
        self.depth = 0  # > 0 while a block's forward runs
        self.in_blocks = 0  # the saved bytes made inside the blocks
        self.widths = {v for k, v in divisible.items() if k.endswith(" features")}
        self.heads = {v for k, v in divisible.items() if not k.endswith((" features", " rows"))}
        self.split: set[int] = set()  # storages of colwise outputs and rowwise inputs
        self.residual = 0  # the blocks' output width: the residual stream's
        # (storage, shape, bytes) of each storage saved, classified at the end: a tensor saved
        # again, or a view of it saved (a Linear saves its input flattened to 2-d), counts once
        self.saved: list[tuple[int, tuple[int, ...], int]] = []
        self.seen: set[int] = set()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        import torch

        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(module: Any, args: Any, output: Any) -> None:
            self.depth -= 1
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.dim() and not self.residual:
                self.residual = int(out.shape[-1])

        def storage(t: Any) -> int:
            return int(t.untyped_storage().data_ptr())

        def colwise(module: Any, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                self.split.add(storage(output))

        def rowwise(module: Any, args: Any) -> None:
            if args and isinstance(args[0], torch.Tensor):
                self.split.add(storage(args[0]))

        handles = [b.register_forward_pre_hook(enter) for b in self.blocks]
        handles += [b.register_forward_hook(leave) for b in self.blocks]
        handles += [m.register_forward_hook(colwise) for m in self.planned["colwise"]]
        handles += [m.register_forward_pre_hook(rowwise) for m in self.planned["rowwise"]]

        def pack(t: Any) -> Any:
            key = storage(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in self.seen and key not in self.params:
                self.seen.add(key)
                n = t.numel() * t.element_size()
                self.saved.append((storage(t), tuple(t.shape), n))
                self.in_blocks += n if self.depth else 0
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.saved)

    def _sharded(self, where: int, shape: tuple[int, ...]) -> bool:
        if where in self.split:
            return True
        if len(shape) == 4 and shape[1] in self.heads:
            return True
        return bool(shape) and shape[-1] in self.widths and shape[-1] != self.residual

    def block_fraction(self) -> float | None:
        """The share of the saved bytes the blocks make (what recomputing them frees)."""
        return self.in_blocks / self.total if self.total and self.blocks else None

    def sharded_fraction(self) -> float | None:
        """None: nothing saved, or no plan (the parameters' fraction stands in)."""
        if not self.total or not (self.widths or self.heads):
            return None
        sharded = sum(n for where, shape, n in self.saved if self._sharded(where, shape))
        return sharded / self.total
