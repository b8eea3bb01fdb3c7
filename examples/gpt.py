"""A small GPT-style language model, trained data-parallel by one decorator.

Run as is, this file is the serial reference program. ``macrogen expand``
turns ``@mg.data_parallel`` into a module that averages gradients over the
data-parallel ranks (under torchrun), with no change to the training loop.
``@mg.tensor_parallel`` on ``Attention`` and ``MLP`` splits their layers over
tensor-parallel ranks when the launch asks for it (``MACROGEN_TP_SIZE=2``, as
``examples/run.py --tp 2`` does); ranks of one tensor group train on the same data.

Factory for benchmarks and autotuning (``--entry examples.gpt:build``)::

    build(*, n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32,
          batch_size=8, seed=0, lr=1e-3) -> (model, step)

``model`` is a ``GPT`` (data-parallel once expanded); ``step()`` runs one
training step (forward, backward, AdamW step) on a fixed random batch of
``batch_size`` sequences and returns the loss as a float. ``batch_size`` is
per rank; every rank draws the same batch (the factory is for timing steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level: any text is a valid input
    block_size: int = 32  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    unused_head: bool = False  # a layer no forward uses (tests unused parameters)


def _scaled_init(proj: nn.Linear, config: GPTConfig) -> None:
    """GPT-2's scaled init of a residual projection.

    Done here, in the module that owns the layer; nanoGPT's way (GPT
    re-drawing ``c_proj.weight`` by name after building its blocks) gives the
    same weights under tensor parallelism too: shards are cut once the
    outermost module is built.
    """
    nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))


@mg.tensor_parallel(plan={"qkv": ("colwise", 3), "proj": "rowwise", "n_head": "divide"})
class Attention(nn.Module):
    """Causal self-attention; ``qkv`` is column-parallel, ``proj`` row-parallel under tensor parallelism."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        _scaled_init(self.proj, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, T, C) (C: this rank's width)
        hs = q.shape[-1] // self.n_head
        q, k, v = (
            t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


@mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
class MLP(nn.Module):
    """``fc`` is column-parallel, ``proj`` row-parallel under tensor parallelism."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        _scaled_init(self.proj, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@mg.data_parallel(bucket_mb=mg.tunable(25, choices=[1, 4, 16, 25, 64]), first_bucket_mb=1)
class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.unused_head:
            self.unused = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(
    config: GPTConfig, batch_size: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch of token ids and their next-token targets, (B, T) each."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def build(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    vocab_size: int = 256,
    block_size: int = 32,
    batch_size: int = 8,
    seed: int = 0,
    lr: float = 1e-3,
):
    """A model and a ``step()`` that trains it one step on a fixed batch and returns the loss."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    idx, targets = batch(config, batch_size, seed=seed + 1)

    def step() -> float:
        optimizer.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    return model, step


if __name__ == "__main__":
    _, step = build()
    for i in range(5):
        print(f"step {i}: loss {step():.4f}")
