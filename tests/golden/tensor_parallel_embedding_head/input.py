import torch.nn as nn

import macrogen as mg


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.out = nn.Linear(d_model, vocab, bias=False)


# The embedding split over the vocabulary; the head (a submodule) split over its inputs.
@mg.tensor_parallel(plan={"wte": "vocab", "head.out": "rowwise"})
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50304, d_model: int = 768):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.head = Head(d_model, vocab)

    def forward(self, idx):
        return self.head.out(self.wte(idx))
