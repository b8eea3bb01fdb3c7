import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

N_LAYER = mg.define(4)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


@mg.pipeline(
    stages=2,
    microbatches=mg.tunable(4, choices=[2, 4, 8]),
    schedule="1f1b",
    split=["blocks.3"],
)
class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, block_size=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def train(model, batches, optimizer):
    for idx, targets in batches:
        optimizer.zero_grad()
        loss = mg.pipeline_step(model, idx, targets, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
        optimizer.step()
