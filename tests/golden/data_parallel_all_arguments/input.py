"""A model trained data-parallel: every argument of @data_parallel given."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

ACCUMULATE = mg.define(4)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


# the model users train; its gradients are averaged over the ranks
@mg.data_parallel(
    bucket_mb=mg.tunable(25, choices=[4, 25]),
    first_bucket_mb=0.5,
    compress="bf16",
    accumulate=ACCUMULATE,
    broadcast_buffers=False,
)
class Model(nn.Module):
    """Blocks and a head."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.blocks(x)).squeeze(-1), y)


def train(model: Model, data, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        for x, y in data:  # ACCUMULATE micro-batches
            (model(x, y) / ACCUMULATE).backward()
        opt.step()
