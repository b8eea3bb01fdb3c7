import torch.distributed as dist

import macrogen as mg

BLOCK = mg.tunable(48, choices=[32, 64])
SIZE = mg.define(len("abc"))


def sync(a, b):
    with mg.fused_allreduce():
        dist.all_reduce(a, async_op=True)
    with mg.fused_allreduce():
        dist.all_reduce(b)
    if mg.targt("cuda"):
        pass
