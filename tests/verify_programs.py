"""Annotated programs for macrogen verify's tests, each written to a file of its own.

Each is a whole source: ``build()`` returns (model, batch[, loss_fn]) after its
``mg.parallelize(...)``, as the verify entry contract says (docs/verify.md).
"""

from __future__ import annotations

from pathlib import Path

LLAMA = """\
import torch
import macrogen as mg
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = mg.parallelize(LlamaForCausalLM(config), tp=2, tp_plan="hf")
    ids = torch.randint(0, 64, (2, 8))
    return model, {"input_ids": ids, "labels": ids}
"""

# An attention that reads its head count from an attribute: sharded q/k/v/o need it divided.
HEADS = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
import macrogen as mg

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n_head = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, C), C / tp on a rank
        head = q.shape[-1] // self.n_head
        q, k, v = (t.view(B, T, self.n_head, head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def undivided():
    model = nn.Sequential(Attention(16, 4))
    model = mg.parallelize(model, tp=2, tp_plan={"0.q": "colwise", "0.k": "colwise",
                                                  "0.v": "colwise", "0.o": "rowwise"})
    return model, torch.randn(2, 6, 16)


def divided():
    model = nn.Sequential(Attention(16, 4))
    model = mg.parallelize(model, tp=2, tp_plan={"0.q": "colwise", "0.k": "colwise",
                                                  "0.v": "colwise", "0.o": "rowwise",
                                                  "0.n_head": "divide"})
    return model, torch.randn(2, 6, 16)
"""

# Gemma's embedding: an nn.Embedding subclass whose forward scales the rows it looks up.
GEMMA = """\
import torch
import torch.nn as nn
import macrogen as mg


class ScaledEmbedding(nn.Embedding):
    def __init__(self, num, dim):
        super().__init__(num, dim)
        self.scale = dim**0.5

    def forward(self, ids):
        return super().forward(ids) * self.scale


def build():
    model = nn.Sequential(ScaledEmbedding(32, 8), nn.Linear(8, 32))
    model = mg.parallelize(model, tp=2, tp_plan={"0": "vocab"})
    return model, torch.randint(0, 32, (2, 5)), lambda out: out.pow(2).mean()
"""


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    return path
