import torch.distributed as dist

import macrogen as mg


def sync(a):
    with mg.fused_allreduce() as fused:
        dist.all_reduce(a)
    with mg.fused_allreduce(), open("x"):
        dist.all_reduce(a)
