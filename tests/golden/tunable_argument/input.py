import torch.distributed as dist

import macrogen as mg

BLOCK = mg.define(256)


def sync(a, b):
    with mg.fused_allreduce(block=mg.tunable(1024, choices=[256, 512, 1024])):
        dist.all_reduce(a)
        dist.all_reduce(b)


def sync_defined(a):
    with mg.fused_allreduce(block=BLOCK):
        dist.all_reduce(a)
