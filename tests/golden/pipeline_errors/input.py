import torch.nn as nn
import macrogen as mg


@mg.pipeline(stages=5, microbatches=8)
class TooManyStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@mg.pipeline(stages=2, split=["blocks.1", "lm_haed"])
class WrongSplit(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.lm_head = nn.Linear(4, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


@mg.pipeline(stages=2, split=["lm_haed"])
class UnknownName(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 4)

    def forward(self, x):
        x = self.body(x)
        return self.lm_head(x)


@mg.pipeline(stages=2, split=["blocks.7"])
class NoSuchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@mg.pipeline(stages=2)
class EarlyReturn(nn.Module):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if x.isnan().any():
            return x
        return self.head(x)


@mg.pipeline(stages=2, split=["b"])
class TwoValues(nn.Module):
    def forward(self, x, mask):
        h = self.a(x)
        h = self.b(h, mask)
        return self.c(h)


@mg.pipeline(stages=2, microbatches=1)
class FewMicrobatches(nn.Module):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@mg.pipeline(stages=2, schedule="interleaved")
class BadSchedule(nn.Module):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@mg.pipeline(stages=2)
class NoLoop(nn.Module):
    def forward(self, x):
        return self.b(self.a(x))
