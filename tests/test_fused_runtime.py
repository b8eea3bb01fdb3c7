"""The fused all-reduce runtime's bookkeeping: buffer plans, steps and their cache."""

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


def kinds(steps) -> list[tuple[str, tuple[int, ...]]]:
    return [(type(s).__name__, s.members) for s in steps]


def test_steps_pack_each_dtype_once_and_reduce_lone_or_large_members_in_place(monkeypatch):
    monkeypatch.setattr(fused, "DIRECT_BYTES", 4000)
    ts = [
        torch.ones(3),
        torch.ones(2, dtype=torch.int64),  # alone in its dtype: reduced in place
        torch.ones(1000),  # 4000 bytes: on its own
        torch.ones(4, 5),
        torch.ones(0),
        torch.ones(2, dtype=torch.bfloat16),
        torch.ones(7, dtype=torch.bfloat16),
    ]
    block = fused.FusedAllReduce(len(ts), where="test.py:1")
    assert kinds(block.steps(ts)) == [
        ("Direct", (2,)),
        ("Packed", (0, 3, 4)),
        ("Direct", (1,)),
        ("Packed", (5, 6)),
    ]


def test_steps_are_planned_once_per_signature_and_reuse_their_buffers():
    block = fused.FusedAllReduce(2, where="test.py:1")
    a, b = [torch.ones(3), torch.ones(4, 5)], [torch.zeros(3), torch.zeros(4, 5)]
    steps = block.steps(a)
    assert block.steps(b) is steps  # same shapes, dtypes, devices: the same plan, same buffers
    (packed,) = steps
    assert packed.buffer.shape == (23,)
    assert [v.data_ptr() for v in packed.views] == [
        packed.buffer.data_ptr(),
        packed.buffer.data_ptr() + 3 * 4,
    ]
    assert block.steps([torch.ones(4), torch.ones(4, 5)]) is not steps  # a new signature
    for n in range(1, 2 * fused.CACHE_SIZE):  # the cache keeps the latest few
        block.steps([torch.ones(n), torch.ones(1)])
    assert len(block._plans) == fused.CACHE_SIZE


def test_a_block_without_a_process_group_changes_nothing():
    block = fused.FusedAllReduce(2, where="test.py:1")
    a, b = torch.arange(3.0), torch.arange(2)
    block(a, b)
    assert a.tolist() == [0.0, 1.0, 2.0] and b.tolist() == [0, 1]
    with pytest.raises(TypeError, match="test.py:1: 2 tensors, not 1"):
        block(a)


def test_torch_path_packs_and_unpacks_non_contiguous_tensors():
    ts = [torch.arange(12.0).view(3, 4).t(), torch.arange(5.0)[::2], torch.tensor(7.0)]
    flat = fused.plan(ts)[0]
    buf = fused.pack_torch(ts, flat)
    assert buf.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 0, 2, 4, 7]
    fused.unpack_torch(buf * 2, ts, flat)
    assert ts[0].tolist() == (torch.arange(12.0).view(3, 4).t() * 2).tolist()
    assert ts[1].tolist() == [0, 4, 8] and ts[2].item() == 14


def test_a_one_off_flat_buffer_is_freed_here_and_a_lone_member_kept():
    """A broadcast's flat buffer is freed on the caller's thread: the process group's worker
    may hold the last reference, and a profiler records no free made on its thread."""
    ts = [torch.ones(3), torch.ones(5)]
    flat = fused.plan(ts)[0]
    buf = fused.pack_torch(ts, flat)
    fused.release(buf, flat)
    assert buf.untyped_storage().nbytes() == 0 and ts[0].sum() == 3  # the members are kept
    lone = [torch.arange(4.0)]
    alone = fused.plan(lone)[0]
    fused.release(fused.pack_torch(lone, alone), alone)  # that member itself: kept
    assert lone[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_tensors_sharing_memory_are_refused():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="share memory"):
        fused._check_distinct([t, t.view(2, 2)])
    fused._check_distinct([t[:2], t[2:], torch.ones(0), torch.ones(0)])  # apart, or empty: fine
