"""Local SGD with DiLoCo's outer optimizer, the synchronization overlapped with the next step."""

import torch
import torch.nn as nn

import macrogen as mg

SYNC_EVERY = mg.tunable(8, choices=[8, 32])


@mg.data_parallel(
    sync_every=SYNC_EVERY,
    outer=mg.outer_sgd(lr=mg.tunable(0.7, choices=[0.5, 0.7]), momentum=0.9, nesterov=True),
    overlap=True,
    delay=1,
)
class Model(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 1)

    def forward(self, x, y):
        return ((self.fc(x).squeeze(-1) - y) ** 2).mean()


@mg.data_parallel(sync_every=4, outer=mg.outer_sgd(lr=1.0, momentum=0.0, nesterov=False))
class Averaged(nn.Module):
    """lr 1 without momentum: the plain average, as outer=None (but through the delta)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 1)
