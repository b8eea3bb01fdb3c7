import torch.distributed as dist

from macrogen import define as const
from macrogen import fused_allreduce as far

SIZE = const(8)


def sync(a, b):
    with far():
        dist.all_reduce(a)
        dist.all_reduce(b)
