import torch.distributed as dist

from macrogen import *

SIZE = define(8)


def sync(a):
    with fused_allreduce():
        dist.all_reduce(a)
    if target("cuda"):
        a.cuda()
