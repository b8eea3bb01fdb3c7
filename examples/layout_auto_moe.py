"""A mixture of experts whose layout, expert parallelism included, `macrogen autotune` chooses.

    macrogen plan examples/layout_auto_moe.py --entry :build --world-size 8 --gpu-memory 80GB
    macrogen autotune examples/layout_auto_moe.py --entry :build --world-size 2

Each block routes every token to its top-2 of 4 experts, stacked as (experts, ...) parameters
and called as ``experts(hidden, top_k_index, top_k_weights)`` (transformers 5's convention,
docs/experts.md), so ``layout="auto"`` offers ep > 1 beside the data, tensor and pipeline
layouts (docs/autotune.md).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

VOCAB, HIDDEN, EXPERTS, TOP_K, BLOCKS, BATCH, SEQ = 64, 32, 4, 2, 2, 8, 16


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS  # ep must divide it
        self.w_in = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * HIDDEN) / (2 * HIDDEN) ** 0.5)

    def forward(self, hidden, top_k_index, top_k_weights):  # (tokens, hidden), (tokens, k) x2
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = F.linear(F.gelu(F.linear(hidden[token], self.w_in[e])), self.w_out[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x):  # (batch, seq, hidden)
        h = self.norm(x).reshape(-1, HIDDEN)
        weights, index = torch.topk(self.router(h).softmax(dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(h, index, weights).view_as(x)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build():
    run = mg.launch()
    model = mg.parallelize(MoE().to(run.device), layout="auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = mg.mesh()
    share = BATCH // mesh.data_size  # the global batch is fixed: each data rank trains its share
    data = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data).to(run.device)
    rows = slice(mesh.data_rank * share, (mesh.data_rank + 1) * share)
    x, y = ids[rows, :-1], ids[rows, 1:]

    def step():
        opt.zero_grad()
        mg.pipeline_step(model, x, y, loss_fn)  # the serial step when pp is 1
        opt.step()

    return model, step, {"tokens": BATCH * SEQ}
