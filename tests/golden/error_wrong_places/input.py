import torch.distributed as dist

import macrogen as mg

x = mg.fused_allreduce()


def f(a):
    SIZE = mg.define(3)
    with mg.target("cuda"):
        dist.all_reduce(a)
    if mg.fused_allreduce():
        pass
    print(mg.define(3))
    return mg.target("cuda") and a
