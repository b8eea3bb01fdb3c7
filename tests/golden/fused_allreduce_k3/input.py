import torch
import torch.distributed as dist

import macrogen as mg


def sync_metrics(loss, correct, seen):
    # one collective instead of three
    with mg.fused_allreduce():
        dist.all_reduce(loss)
        dist.all_reduce(correct)
        dist.all_reduce(seen)
    return loss / seen, correct / seen
