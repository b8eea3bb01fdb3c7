import torch.distributed as dist

import macrogen as mg


class Trainer:
    def step(self, loss, seen):
        def sync():
            with mg.fused_allreduce():
                dist.all_reduce(loss)
                dist.all_reduce(seen)

        sync()
        if mg.target("cuda"):
            return loss.cuda()
        return loss


def outer(x):
    def inner(y):
        with mg.fused_allreduce():
            dist.all_reduce(y)

    inner(x)
