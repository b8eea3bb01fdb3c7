"""Mixture-of-experts models for the expert-parallel tests and bench: transformers' families from
shrunk configs, a router biased to load its experts unevenly, and a plain MoE of our own.

``PlainMoE`` is the model a user writes (torchtitan's layout: a router, then experts stacked
as ``(experts, ...)`` parameters, called as ``experts(hidden, top_k_index, top_k_weights)``);
``ListMoE`` keeps its experts in ``nn.ModuleList``s looped over in its blocks' forward (Mixtral
before transformers 5, torchtitan-style and nanoGPT-MoE forks), in two forms of the loop.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS_PER_ROW = 8


class StackedExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, inner: int):
        super().__init__()
        self.num_experts = experts
        self.hidden_dim = hidden
        self.w_in = nn.Parameter(torch.randn(experts, inner, hidden) / hidden**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inner) / inner**0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = F.linear(F.gelu(F.linear(hidden[token], self.w_in[e])), self.w_out[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class PlainBlock(nn.Module):
    def __init__(self, hidden: int, experts: int, k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = StackedExperts(experts, hidden, 2 * hidden)
        self.k = k

    def forward(self, x):
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(h).softmax(dim=-1), self.k, dim=-1)
        return x + self.experts(h, index, weights / weights.sum(-1, keepdim=True)).view_as(x)


class PlainMoE(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16, experts: int = 4, k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([PlainBlock(hidden, experts, k) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ListBlock(nn.Module):
    """A router (``gate``) and experts in an ``nn.ModuleList``, looped over in the block's own
    forward: every expert in turn (``hit=False``), or only the experts hit (Mixtral's
    ``expert_hit`` loop before transformers 5)."""

    def __init__(self, hidden: int, experts: int, k: int, hit: bool, starved: int | None,
                 dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.gate = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList([Expert(hidden, 2 * hidden) for _ in range(experts)])
        self.k, self.hit = k, hit
        if starved is not None:  # a router that never picks this expert
            with torch.no_grad():
                self.gate.bias[starved] = -1e4

    def forward(self, x):
        h = self.drop(self.norm(x)).reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.gate(h).softmax(dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        if self.hit:
            mask = F.one_hot(index, len(self.experts)).permute(2, 1, 0)  # (experts, k, tokens)
            for e in (mask.sum(dim=(-1, -2)) > 0).nonzero():
                slot, token = torch.where(mask[e[0]])
                out.index_add_(0, token, self.experts[e](h[token]) * weights[token, slot, None])
        else:
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(index == e)
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return x + out.view_as(x)


class ListMoE(nn.Module):
    """``PlainMoE`` with its experts in ``nn.ModuleList``s (``ListBlock``)."""

    def __init__(self, vocab: int = 64, hidden: int = 16, experts: int = 4, k: int = 2,
                 hit: bool = False, starved: int | None = None, dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [ListBlock(hidden, experts, k, hit, starved, dropout) for _ in range(2)]
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def transformers_model(model_type: str) -> nn.Module:
    """A transformers causal LM of ``model_type`` from the family sweep's shrunk config."""
    import transformers

    from tests.hf_families import Family, build, shrunk_config

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    name = config_class.__name__.removesuffix("Config") + "ForCausalLM"
    family = Family(model_type, name, config_class)
    return build(family, shrunk_config(family))


def biased_forward(
    router: nn.Module, bias: torch.Tensor, hidden_states: torch.Tensor, exact: bool = False
) -> Any:
    """transformers' top-k router (Qwen2-MoE's, Mixtral's) with ``bias`` added to its logits;
    ``exact``: its softmax in the model's dtype, not float32 (whose rounding turns a float64
    summation-order difference upstream, tensor parallelism's, into a float32-sized one)."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden_states, router.weight) + bias
    probs = torch.softmax(logits, dtype=logits.dtype if exact else torch.float, dim=-1)
    top, index = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def bias_routers(model: nn.Module, bias: list[float], exact: bool = False) -> None:
    """Every top-k router of ``model`` favours the experts ``bias`` favours (in place);
    ``exact``: with its softmax in the model's dtype (``biased_forward``)."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            b = torch.tensor(bias, dtype=module.weight.dtype)
            module.forward = functools.partial(biased_forward, module, b, exact=exact)


def batches(steps: int, rows: int, vocab: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (rows, TOKENS_PER_ROW), generator=gen) for _ in range(steps)]
