import torch.distributed as dist

import macrogen as mg


def sync(a, mg):
    # mg is a parameter here, not macrogen: nothing to expand
    with mg.fused_allreduce():
        dist.all_reduce(a)


def sync_real(a):
    with mg.fused_allreduce():
        dist.all_reduce(a)
