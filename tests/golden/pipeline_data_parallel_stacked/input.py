import torch.nn as nn
import macrogen as mg


@mg.data_parallel(bucket_mb=1)
@mg.pipeline(stages=2, microbatches=4, split=["blocks.2"])
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)
