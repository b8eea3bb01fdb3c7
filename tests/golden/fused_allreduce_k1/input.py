import torch.distributed as dist

import macrogen as mg


def sync_loss(loss):
    with mg.fused_allreduce():
        dist.all_reduce(loss)
