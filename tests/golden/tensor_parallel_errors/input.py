import torch.nn as nn

import macrogen as mg


class Block(nn.Module):
    def __init__(self, d_model, n_head, vocab):
        super().__init__()
        self.n_head = n_head
        self.dropout = 0.1
        self.wte = nn.Embedding(vocab, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)


# One error per site: each class shows one.
@mg.tensor_parallel(plan={"qkv": "colwise", "extra": "colwise", "prj": "rowwise"})
class UnknownKey(Block):
    def __init__(self, d_model, n_head, vocab):
        super().__init__(d_model, n_head, vocab)
        self.extra = nn.Linear(d_model, d_model)


@mg.tensor_parallel(plan={"block.wte": "colwise"})
class WrongLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(64, 4, 100)


@mg.tensor_parallel(plan={"block.n_head": "divde"})
class UnknownStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(64, 4, 100)


@mg.tensor_parallel(plan={"block.dropout": "divide"})
class NotAnInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(64, 4, 100)


@mg.tensor_parallel(plan={"block.qkv": "colwise"}, size=3.5)
class BadSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(64, 4, 100)
