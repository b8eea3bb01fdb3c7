import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg


class GPTBase(nn.Module):
    def __init__(self, n_layer=4):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(64, 32),
            h=nn.ModuleList([nn.Linear(32, 32) for _ in range(4)]),
            ln_f=nn.LayerNorm(32),
        ))
        self.lm_head = nn.Linear(32, 64, bias=False)


@mg.pipeline(stages=2, split=["transformer.h.9"])
class NoSuchBlock(GPTBase):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])))

    def forward(self, x):
        for block in self.transformer.h:
            x = block(x)
        return x


@mg.pipeline(stages=2, split=["transformer.lnf"])
class Misspelt(GPTBase):
    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


@mg.pipeline(stages=2, split=["lm_head"])
class InsideAnIf(GPTBase):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        else:
            logits, loss = self.lm_head(x), None
        return logits, loss


@mg.pipeline(stages=2, split=["transformer.h"])
class TheListItself(GPTBase):
    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(x)


@mg.pipeline(stages=2, split=["transformer.h.2"])
class TargetsTooEarly(GPTBase):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) * (targets is not None)
        for block in self.transformer.h:
            x = block(x) + targets
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())
