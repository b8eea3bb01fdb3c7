import torch.nn as nn
from macrogen import pipeline, pipeline_step


@pipeline(stages=3, schedule="gpipe")
class Deep(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return self.head(x)


def step(model, x, y, loss_fn):
    return pipeline_step(model, x, y, loss_fn)
