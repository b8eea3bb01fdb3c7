import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


# nanoGPT's fused q, k, v: forward chunks the output in 3, so each block is split on its own.
@mg.tensor_parallel(plan={"c_attn": ("colwise", 3), "c_proj": "rowwise", "n_head": "divide"})
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # (B, T, C / tp) each
        hs = q.size(-1) // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
