"""A model of the user's own, trained fully sharded (FSDP2): every FSDP argument given."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


@mg.data_parallel(
    shard="full",
    reshard_after_forward=mg.tunable(True, choices=[True, False]),
    mixed_precision="bf16",
    cpu_offload=False,
    shard_units=["blocks.*"],
    dp_replicate=2,
    accumulate=2,
)
class Model(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


@mg.data_parallel(shard="full")
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


def train(model: Model, data) -> None:
    opt = torch.optim.AdamW(model.parameters())
    for x in data:
        model(x).backward()
        opt.step()
        opt.zero_grad()
