"""nanoGPT's configure_optimizers, with the optimizer's state sharded (ZeRO-1)."""

import torch
import torch.nn as nn

import macrogen as mg


@mg.data_parallel
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x)).square().mean()


def configure_optimizers(model, weight_decay, learning_rate, betas):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel over this rank's share
    return mg.shard_optimizer(torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True))
