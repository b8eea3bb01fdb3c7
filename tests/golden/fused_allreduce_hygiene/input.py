import torch.distributed as dist

import macrogen as mg

triton = "user's triton"
tl = None
_fused_allreduce_l10 = "taken"


def sync(all_reduce_fused, b):
    with mg.fused_allreduce():
        dist.all_reduce(all_reduce_fused)
        dist.all_reduce(b)
