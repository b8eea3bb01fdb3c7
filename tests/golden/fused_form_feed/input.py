import torch.distributed as dist

import macrogen as mg


def sync(a, b):
    total = a.sum()
    with mg.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
    return total
