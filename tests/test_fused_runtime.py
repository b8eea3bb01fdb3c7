"""The fused all-reduce runtime's bookkeeping: buffer plans and kernel arguments."""

import pytest
import torch

from macrogen.runtime import fused


def test_plan_groups_by_dtype_in_order_of_first_appearance():
    ts = [
        torch.ones(3),
        torch.ones(2, dtype=torch.int64),
        torch.ones(()),
        torch.ones(0),
        torch.ones(4, 5),
    ]
    plans = fused.plan(ts)
    assert [(p.dtype, p.members, p.sizes, p.offsets, p.numel) for p in plans] == [
        (torch.float32, (0, 2, 3, 4), (3, 1, 0, 20), (0, 3, 4, 4), 24),
        (torch.int64, (1,), (2,), (0,), 2),
    ]


def test_kernel_args_give_the_buffer_for_tensors_with_nothing_to_copy():
    ts = [torch.ones(3000), torch.ones(2, dtype=torch.int64), torch.ones(0), torch.ones(17)]
    flat = fused.plan(ts)[0]
    buf = torch.empty(flat.numel)
    args, grid = fused.kernel_args(buf, ts, flat, 1024)
    assert args[0] is buf
    assert args[1] is ts[0] and args[2] is buf and args[3] is buf and args[4] is ts[3]
    assert args[5:9] == [3000, 0, 0, 17]  # elements
    assert args[9:13] == [0, 0, 3000, 3000]  # offsets in the buffer
    assert args[13:] == [3, 3, 3]  # first program of tensors 1..3
    assert grid == 4


def test_torch_path_packs_and_unpacks_non_contiguous_tensors():
    ts = [torch.arange(12.0).view(3, 4).t(), torch.arange(5.0)[::2], torch.tensor(7.0)]
    flat = fused.plan(ts)[0]
    buf = fused.pack_torch(ts, flat)
    assert buf.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 0, 2, 4, 7]
    fused.unpack_torch(buf * 2, ts, flat)
    assert ts[0].tolist() == (torch.arange(12.0).view(3, 4).t() * 2).tolist()
    assert ts[1].tolist() == [0, 4, 8] and ts[2].item() == 14


def test_tensors_sharing_memory_are_refused():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="share memory"):
        fused._check_distinct([t, t.view(2, 2)])
    fused._check_distinct([t[:2], t[2:], torch.ones(0), torch.ones(0)])  # apart, or empty: fine
