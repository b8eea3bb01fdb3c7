import torch.distributed as dist

import macrogen.markers as mm

SIZE = mm.define(8)


def sync(a, b):
    with mm.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
