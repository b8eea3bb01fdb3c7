"""A transformer block's attention and MLP, each split over the tensor-parallel group."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


@mg.tensor_parallel(plan={"qkv": "colwise", "proj": "rowwise", "n_head": "divide"})
class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)  # head-major: (n_head, 3 * head_dim)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_head, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


# A tunable degree: `macrogen autotune` may pick it.
@mg.tensor_parallel(
    plan={"fc": "colwise", "proj": "rowwise", "ln": "replicate"},
    size=mg.tunable(2, choices=[1, 2, 4]),
)
class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))
