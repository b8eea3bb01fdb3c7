import torch.nn as nn

import macrogen as mg


# Computed on before it leaves forward: a softmax over this rank's slice of the vocabulary.
@mg.tensor_parallel(plan={"lm_head": "colwise"})
class Probabilities(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 512):
        super().__init__()
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):
        logits = self.lm_head(x)
        return logits.softmax(-1)


# A packed output gathered whole would interleave the ranks' blocks.
@mg.tensor_parallel(plan={"qkv": ("colwise", 3)})
class Packed(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        return self.qkv(x)
