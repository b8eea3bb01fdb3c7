"""nanoGPT's GPT as written: a ModuleDict, the tied wte/lm_head weight, forward computing its loss."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 4
    n_embd: int = 32


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        return x + self.fc(self.ln(x))


@mg.pipeline(stages=2, microbatches=4, schedule="1f1b", split=["transformer.h.2"])
class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: the last position only
            loss = None
        return logits, loss


def train(model, batches, optimizer):
    for X, Y in batches:
        optimizer.zero_grad()
        loss = mg.pipeline_step(model, X, Y)  # serially: logits, loss = model(X, Y); loss.backward()
        optimizer.step()
