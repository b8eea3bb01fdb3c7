"""A model as ``macrogen plan`` sees it from its shapes: parameters, FLOPs and activations.

Made by ``meta_model`` from a transformers config (or a model built on the meta
device): one block is run forward and backward on meta tensors under torch's
``FlopCounterMode`` with autograd's saved-tensor hooks, so nothing is allocated and
nothing is timed. Per-token figures are at ``seq`` tokens per sequence (attention's
FLOPs grow with it). Stored as JSON (``to_json``/``from_json``), so a plan can be
repeated, and tested, without torch. Pure: no torch.

    spec.model_flops_per_token     6N + 12 L h s, the FLOPs MFU counts (PaLM's convention)
    spec.step_flops_per_token(r)   what a step computes per token, a share r of blocks recomputed
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int  # repeated blocks
    hidden: int  # the residual stream's width
    seq: int  # tokens per sequence the per-token figures are measured at
    params: int  # every parameter
    block_params: int  # one block's
    block_sharded_params: int  # of those, in the tensor-parallel plan's layers
    embed_params: int  # the input embedding (vocabulary-sharded under tp)
    head_params: int  # the output head (0: tied to the embedding)
    # forward FLOPs per token, of one block and of the rest (embedding, norm, head, loss)
    block_forward_flops: float
    rest_forward_flops: float
    # backward FLOPs per token (about twice the forward: the gradients of inputs and weights)
    block_backward_flops: float
    rest_backward_flops: float
    # of the block's (forward + backward), attention's; causal attention computes half of it
    block_attention_flops: float
    # bytes autograd saves per token: in one block; outside them (the head's logits and loss)
    block_activation_bytes: float
    rest_activation_bytes: float
    block_input_bytes: float  # one block's input per token: what a recomputed block keeps
    # every size tensor parallelism must divide: "num_attention_heads" -> 32, ...
    divisible: Mapping[str, int] = field(default_factory=dict)
    causal: bool = True
    param_bytes: int = 2  # the compute dtype's bytes (bf16): parameters gathered, activations
    source: str = ""  # where the shapes came from (a config file, a meta model)
    # a mixture of experts: experts per MoE block, of block_params the experts', pairs per token
    experts: int = 0
    block_expert_params: int = 0
    top_k: int = 0

    @property
    def block_flops(self) -> float:
        return self.block_forward_flops + self.block_backward_flops

    @property
    def rest_flops(self) -> float:
        return self.rest_forward_flops + self.rest_backward_flops

    @property
    def model_flops_per_token(self) -> float:
        """What MFU counts per token: 3 x the forward (forward and backward), attention whole."""
        return 3 * (self.layers * self.block_forward_flops + self.rest_forward_flops)

    def block_time_flops(self, recomputed: float = 0.0) -> float:
        """One block's FLOPs per token as a GPU runs them: causal attention skips half of its
        score matrix; a recomputed block (a share ``recomputed``) runs its forward twice."""
        attention = self.block_attention_flops / 2 if self.causal else 0.0
        forward_share = self.block_forward_flops / self.block_flops if self.block_flops else 0.0
        run = self.block_flops - attention
        return run * (1 + recomputed * forward_share)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a model spec is a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"a model spec has no field {sorted(unknown)[0]!r}")
        return cls(**data)

    @classmethod
    def read(cls, path: Path) -> ModelSpec:
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a model spec ({e})") from None


def looks_like_spec(data: Mapping[str, Any]) -> bool:
    """A JSON object that is a stored ``ModelSpec`` (not a transformers config)."""
    return "block_forward_flops" in data and "layers" in data
