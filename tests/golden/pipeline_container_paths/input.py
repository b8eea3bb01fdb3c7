import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

N_LAYER = mg.define(4)


@mg.pipeline(stages=2, microbatches=4)
class Balanced(nn.Module):
    """No split: the blocks of self.body.layers (a Sequential in a ModuleDict) are balanced."""

    def __init__(self, d=16):
        super().__init__()
        self.body = nn.ModuleDict({
            "inp": nn.Linear(d, d),
            "layers": nn.Sequential(*[nn.Linear(d, d) for _ in range(3)]),
        })
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        x = F.relu(self.body.inp(x))
        for layer in self.body.layers:
            x = F.relu(layer(x))
        return self.head(x)


@mg.pipeline(stages=3, microbatches=4, schedule="gpipe", split=["stack.blocks.2", "stack.norm"])
class Split(nn.Module):
    """split names reach through the containers: a block of the inner list, an entry of the dict."""

    def __init__(self, d=16):
        super().__init__()
        self.stack = nn.ModuleDict(dict(
            emb=nn.Embedding(32, d),
            blocks=nn.ModuleList(nn.Linear(d, d) for _ in range(N_LAYER)),
            norm=nn.LayerNorm(d),
        ))
        self.head = nn.Linear(d, 32)

    def forward(self, idx):
        x = self.stack.emb(idx)
        for block in self.stack.blocks:
            x = block(x)
        x = self.stack.norm(x)
        return self.head(x)
