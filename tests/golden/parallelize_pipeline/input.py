import torch.nn as nn

import macrogen as mg


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = mg.parallelize(Net(), pp=2, microbatches=4)
model = mg.parallelize(Net(), pp=2, microbatches=8, schedule="interleaved", dp="fsdp")
model = mg.parallelize(
    Net(),
    pp=2,
    tp=2,
    tp_plan={"emb": "vocab", "head": "colwise_gather_output"},
    microbatches=4,
    recompute="blocks",
)
