import torch.distributed as dist

import macrogen as mg


def sync(a, b, comm):
    # comm is the user's own object: its all_reduce is not torch.distributed's
    with mg.fused_allreduce():
        comm.all_reduce(a)
        dist.all_reduce(b)


def sync_other(a, dist):
    # a parameter named dist shadows the import
    with mg.fused_allreduce():
        dist.all_reduce(a)
