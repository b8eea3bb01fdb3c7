"""The share of a ``ShardedOptimizer`` stepped as flat runs instead of one piece per parameter.

A run is a maximal stretch of consecutive pieces of one bucket's share in one
parameter group: a contiguous slice of the bucket's flat buffer, as is its
gradient. The local optimizer steps the run as one tensor, so a multi-tensor
(foreach) or fused step launches a few kernels per run instead of a few per
parameter (on CPU each op on each tensor costs a dispatch). An element-wise
update of a concatenation is the concatenation of the updates, as long as the
pieces' per-tensor state (Adam's ``step``) is the same, which it is while they
are stepped together; ``tests/test_zero_runs.py`` checks the foreach results
bit for bit against one piece per parameter.

A run is split into its pieces (for good: their state becomes views of the
run's) when one of them must be stepped apart: no rank had a gradient for its
parameter (the serial optimizer skips it), or a loaded state_dict gives its
pieces different states. A split run steps exactly as one piece per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from macrogen.runtime.zero_buckets import Piece, ShardBucket

# torch.optim classes whose update is element-wise with per-tensor state that depends on
# the step count only: stepping a run equals stepping its pieces. Other optimizers (a
# subclass, a third-party class) are stepped one piece per parameter, as before.
FLAT_SAFE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
        torch.optim.Adadelta,
    }
)


@dataclass
class Run:
    """Consecutive pieces of one bucket's share in one parameter group."""

    bucket: ShardBucket
    group: int  # the user's parameter group
    pieces: list[Piece]
    at: int  # first element within the rank's chunk of the bucket
    tensor: torch.Tensor  # 1-D view of the bucket's buffer over the pieces
    flat: bool  # stepped as one tensor (else piece by piece)

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def grad(self) -> torch.Tensor:
        """The run's slice of the bucket's averaged gradients."""
        return self.bucket.grad[self.at : self.at + self.numel]

    def units(self) -> list[torch.Tensor]:
        """What the local optimizer steps for this run."""
        return [self.tensor] if self.flat else [pc.tensor for pc in self.pieces]


def make_runs(buckets: list[ShardBucket], flat: bool) -> list[Run]:
    """The runs of every bucket's share (each piece its own, unsplittable, when not ``flat``)."""
    runs: list[Run] = []
    for bucket in buckets:
        spans: list[list[Piece]] = []
        for pc in bucket.pieces:
            if flat and spans and spans[-1][-1].group == pc.group:
                spans[-1].append(pc)
            else:
                spans.append([pc])
        for span in spans:
            first, last = span[0], span[-1]
            tensor = bucket.mine[first.at : last.at + last.tensor.numel()]
            runs.append(Run(bucket, first.group, span, first.at, tensor, flat))
    # (a run of one piece is flat as well: its tensor is the piece's elements)
    return runs


def split(run: Run, local: torch.optim.Optimizer) -> None:
    """Step ``run`` piece by piece from now on; its state becomes its pieces' (views)."""
    if not run.flat:
        return
    run.flat = False
    for g in local.param_groups:
        params = g["params"]
        for k, t in enumerate(params):
            if t is run.tensor:
                params[k : k + 1] = [pc.tensor for pc in run.pieces]
                break
    state = local.state.pop(run.tensor, None)
    run.tensor.grad = None
    if state:
        for pc in run.pieces:
            local.state[pc.tensor] = piece_state(run, pc, state, view=True)


def piece_state(run: Run, pc: Piece, state: dict[str, Any], *, view: bool) -> dict[str, Any]:
    """``pc``'s part of the run's state: its slice of each element-wise entry."""
    lo = pc.at - run.at
    n = pc.tensor.numel()
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == run.numel:
            out[key] = value[lo : lo + n] if view else value[lo : lo + n].clone()
        else:  # per tensor (Adam's step): each piece its own copy
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def load_run(run: Run, local: torch.optim.Optimizer, states: list[dict[str, Any] | None]) -> None:
    """Put the pieces' loaded states (one per piece) into the optimizer, flat if they agree.

    They agree when every piece has state, with the same keys and the same per-tensor
    values (Adam's step): then the run's state is their element-wise entries end to end.
    Otherwise the run is split and each piece keeps its own.
    """
    if run.flat and _agree(run, states):
        first = states[0]
        assert first is not None
        merged: dict[str, Any] = {}
        for key, value in first.items():
            if _elementwise(value, run.pieces[0]):
                parts = [s[key] for s in states if s is not None]
                merged[key] = torch.cat([p.reshape(-1) for p in parts])
            else:
                merged[key] = value
        local.state[run.tensor] = merged
        return
    split(run, local)
    for pc, state in zip(run.pieces, states):
        if state is not None:
            local.state[pc.tensor] = state


def _elementwise(value: Any, pc: Piece) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == pc.tensor.numel()


def _agree(run: Run, states: list[dict[str, Any] | None]) -> bool:
    if any(s is None for s in states):
        return False
    first = states[0]
    assert first is not None
    for pc, s in zip(run.pieces, states):
        assert s is not None
        if s.keys() != first.keys():
            return False
        for key, value in s.items():
            mine, ref = _elementwise(value, pc), _elementwise(first[key], run.pieces[0])
            if mine != ref:
                return False
            if mine:
                if value.dtype != first[key].dtype or value.device != first[key].device:
                    return False
            elif torch.is_tensor(value) != torch.is_tensor(first[key]):
                return False
            elif torch.is_tensor(value):
                if not (
                    value.shape == first[key].shape
                    and value.dtype == first[key].dtype
                    and torch.equal(value, first[key])
                ):
                    return False
            elif value != first[key]:
                return False
    return True
