"""What stands, on a rank, where a transformers model's other stages' parts were.

Every stage runs the model's own forward (``pipeline_transformers``); the parts it does not
hold are replaced by these, which read the stage running now from the cut's ``Relay``:

- ``PassedLayer``, a layer of another stage: passes its hidden-state input on; the one
  just before the running stage's first layer gives the hidden state the stage received;
  the one just after its last layer ends the stage (``Handoff``, carrying its input);
- ``EmbeddingElsewhere``, an embedding of an earlier stage: zeros of its output's shape, in
  the hidden state's dtype (what forward computes from them is dropped at the stage's
  first layer; the check before the cut makes sure of it).

Outside a stage's run (the relay idle) they raise, as ``Elsewhere`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macrogen.runtime.pipeline_parts import elsewhere


@dataclass
class Running:
    """The stage running now: its layers [start, end) (end None: to the end), what it received."""

    start: int
    end: int | None
    received: torch.Tensor | None


class Relay:
    """The stage running now, for the stand-ins (None between stages' runs)."""

    def __init__(self) -> None:
        self.running: Running | None = None


class Handoff(Exception):
    """The stage ended (its last layer ran): the hidden state it sends on."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("a pipeline stage's end")
        self.hidden = hidden


class PassedLayer(nn.Module):
    """A layer another stage holds: passes its input on (see the module docstring)."""

    def __init__(self, part: str, index: int, stage: int, relay: Relay):
        super().__init__()
        self.part, self.index, self.stage = part, index, stage
        self.relay = relay  # (no module: the stage running now)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self.relay.running
        if run is None:
            raise elsewhere(self.part, self.stage)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if self.index == run.end:
            assert isinstance(hidden, torch.Tensor), "a layer's hidden state (checked at the cut)"
            raise Handoff(hidden)
        if self.index == run.start - 1:
            return run.received
        return hidden

    def extra_repr(self) -> str:
        return f"{self.part!r} on stage {self.stage}"


class EmbeddingElsewhere(nn.Module):
    """An embedding another stage holds: zeros of its output's shape, in the hidden state's dtype
    (what forward computes from them is dropped where this stage's first layer starts)."""

    def __init__(self, part: str, dim: int, stage: int, relay: Relay):
        super().__init__()
        self.part, self.dim, self.stage = part, dim, stage
        self.relay = relay
        self.made: list[torch.Tensor] | None = None  # the check's: the zeros, as graph leaves

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        run = self.relay.running
        if run is None or run.received is None:
            raise elsewhere(self.part, self.stage)
        dtype = run.received.dtype
        zeros = torch.zeros(*ids.shape, self.dim, dtype=dtype, device=ids.device)
        if self.made is not None:
            self.made.append(zeros.requires_grad_())
        return zeros

    def extra_repr(self) -> str:
        return f"{self.part!r} on stage {self.stage}"
