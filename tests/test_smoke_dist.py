"""The spawning harness itself: two gloo ranks sum a tensor."""

from tests.distributed import run_ranks


def _sum(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_two_gloo_ranks_all_reduce():
    assert run_ranks(_sum, 2, timeout=60) == [3.0, 3.0]
