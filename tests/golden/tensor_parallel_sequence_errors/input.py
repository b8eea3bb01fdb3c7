import torch.nn as nn

import macrogen as mg


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.attn = nn.MultiheadAttention(d, 4)
        self.n_head = 4

    def forward(self, x):
        return self.proj(self.fc(self.ln(x)))


@mg.tensor_parallel(plan={"fc": "sequence", "attn": "sequence", "n_head": "sequence"})
class NotPerToken(Block):
    pass


@mg.tensor_parallel(plan={"fc": "from sequence", "proj": "rowwise to sequense"})
class FromSequenceOnALinear(Block):
    pass


@mg.tensor_parallel(plan={"fc": "colwise from sequence", "proj": "rowwise to sequence"})
class SizesOfASlice(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        return self.proj(self.fc(x).view(B, T, 4, C).sum(2))
