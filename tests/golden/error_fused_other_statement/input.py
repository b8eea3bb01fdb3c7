import torch.distributed as dist

import macrogen as mg


def sync(a, b):
    with mg.fused_allreduce():
        dist.all_reduce(a)
        b.div_(2)
        dist.broadcast(b, 0)
