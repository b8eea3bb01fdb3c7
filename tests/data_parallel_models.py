"""Models for the data-parallel tests, as users write them (unexpanded: the serial reference).

``tests/test_data_parallel_dist.py`` expands this file and trains each class on 2
gloo ranks against the serial run and torch DDP.
"""

import torch
import torch.nn as nn

import macrogen as mg
from examples.gpt import GPT


@mg.data_parallel
class Plain(GPT):
    pass


@mg.data_parallel(accumulate=4)
class Accumulating(GPT):
    pass


@mg.data_parallel(bucket_mb=0.002, first_bucket_mb=0.001)  # a bucket every few tensors
class ManyBuckets(GPT):
    pass


@mg.data_parallel(compress="bf16", bucket_mb=0.05)
class CompressedBF16(GPT):
    pass


@mg.data_parallel(compress="fp16")
class CompressedFP16(GPT):
    pass


@mg.data_parallel(bucket_mb=0.0003, first_bucket_mb=0.0003)
class Branchy(nn.Module):
    """``b`` runs only for inputs whose first entry is positive (so on some ranks only); ``never`` never runs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        y = torch.tanh(self.a(x))
        if x[0, 0] > 0:
            y = self.b(y)
        return (y**2).mean()


@mg.data_parallel
class Replaceable(nn.Module):
    """``w`` is replaced after construction (as nanoGPT's crop_block_size replaces wpe.weight)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return ((self.lin(x) @ self.w) ** 2).mean()


@mg.data_parallel(sync_every=4)
class LocalSGD4(GPT):
    pass


@mg.data_parallel(sync_every=2, sync_warmup=3)
class LocalSGDWarm(GPT):
    pass


@mg.data_parallel
class WithBatchNorm(nn.Module):
    """BatchNorm buffers (broadcast from rank 0 before each training forward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return (self.bn(self.lin(x)) ** 2).mean()


def sharded_adamw(params):
    """The optimizer annotated as a user would: AdamW's state sharded over the ranks."""
    return mg.shard_optimizer(torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95)))
