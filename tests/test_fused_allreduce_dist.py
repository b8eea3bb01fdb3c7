"""fused_allreduce parity: the expanded block against the unexpanded one (K all_reduce calls).

Both run on the same random tensors on 2 gloo ranks: random shapes (0-d,
empty, ragged), non-contiguous views, float32/float64/int64/bfloat16 mixed in
one block, op SUM and MAX, with and without ``group=``. Results must be equal
bit for bit (each element is reduced by the same collective either way), and
the expanded block must issue one collective per dtype (and one for each member
large enough to be reduced on its own). In the steady state a block dispatches
nothing but, per dtype, a foreach copy, the collective and a foreach copy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from macrogen.expand import expand_source
from tests.distributed import run_ranks

SOURCE = """\
import torch.distributed as dist

import macrogen as mg


def sync_sum(a, b, c, d, e, f):
    with mg.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
        dist.all_reduce(c)
        dist.all_reduce(d)
        dist.all_reduce(e)
        dist.all_reduce(f)


def sync_max(a, b, c, d, group):
    with mg.fused_allreduce(block=64):
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)


def sync_one(a, group):
    with mg.fused_allreduce():
        dist.all_reduce(a, dist.ReduceOp.SUM, group)
"""

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _tensors(k: int, rank: int, seed: int) -> list[torch.Tensor]:
    """Shapes and dtypes the same on every rank (seed), values different (rank)."""
    shapes = torch.Generator().manual_seed(seed)
    values = torch.Generator().manual_seed(seed * 100 + rank)
    out = []
    for _ in range(k):
        kind = int(torch.randint(0, 5, (1,), generator=shapes))
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=shapes))]
        if kind == 0:
            shape: tuple[int, ...] = ()
        elif kind == 1:
            shape = (0, int(torch.randint(1, 4, (1,), generator=shapes)))
        else:
            shape = tuple(int(s) for s in torch.randint(1, 40, (kind,), generator=shapes))
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=values, dtype=torch.float64).to(dtype)
        else:
            t = torch.randint(-(10**6), 10**6, shape, generator=values, dtype=dtype)
        if kind >= 2 and int(torch.randint(0, 2, (1,), generator=shapes)):
            t = t.transpose(0, -1)  # non-contiguous
        out.append(t)
    return out


def _reference(fn, tensors, *extra) -> list[torch.Tensor]:
    # gloo reduces a non-contiguous tensor's storage as if it were contiguous (wrong),
    # so the reference runs on contiguous copies: the values the serial program means.
    copies = [t.contiguous() for t in tensors]
    fn(*copies, *extra)
    return copies


def _count_collectives(run) -> int:
    import torch.distributed as dist

    calls = 0
    real = dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        run()
    finally:
        dist.all_reduce = real
    return calls


def _parity(rank: int, world_size: int, reference_path: str, expanded_path: str, trials: int):
    import torch.distributed as dist

    ref = _load(reference_path, "fused_parity_reference")
    exp = _load(expanded_path, "fused_parity_expanded")
    group = dist.new_group(list(range(world_size)))
    checked = []
    for trial in range(trials):
        cases = [
            ("sum", ref.sync_sum, exp.sync_sum, _tensors(6, rank, 1000 + trial), ()),
            ("max", ref.sync_max, exp.sync_max, _tensors(4, rank, 2000 + trial), (group,)),
            ("one", ref.sync_one, exp.sync_one, _tensors(1, rank, 3000 + trial), (group,)),
        ]
        for name, reference, expanded, tensors, extra in cases:
            want = _reference(reference, [t.clone() for t in tensors], *extra)
            got = list(tensors)  # reduced in place, non-contiguous views included
            collectives = _count_collectives(lambda: expanded(*got, *extra))  # noqa: B023
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype and g.shape == w.shape, (name, trial, i)
                assert torch.equal(g, w), f"{name} trial {trial}: tensor {i} ({g.dtype}) differs"
            assert collectives == _expected_collectives(tensors), (name, trial, collectives)
            checked.append((name, [str(t.dtype) for t in tensors]))
    return checked


def _expected_collectives(tensors: list[torch.Tensor]) -> int:
    """One per dtype, plus one per member of DIRECT_BYTES or more that has company."""
    from macrogen.runtime.fused import DIRECT_BYTES

    count = 0
    for dtype in {t.dtype for t in tensors}:
        sizes = [t.numel() * t.element_size() for t in tensors if t.dtype == dtype]
        large = sum(n >= DIRECT_BYTES for n in sizes) if len(sizes) > 1 else 0
        count += large + (len(sizes) > large)
    return count


def _steady_state(rank: int, world_size: int):
    """The ops one block dispatches once its plan exists: nothing allocates, nothing else runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from macrogen.runtime.fused import FusedAllReduce

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def tensors(step: int) -> list[torch.Tensor]:  # new tensors every step, same signature
        g = torch.Generator().manual_seed(step * 10 + rank)
        return [torch.randn(n, generator=g) for n in (1, 3, 100, 7)] + [
            torch.randint(0, 9, (5,), generator=g),
            torch.randint(0, 9, (2, 2), generator=g),
            torch.randn(4, generator=g).to(torch.bfloat16),
        ]

    block = FusedAllReduce(7, where="test.py:1")
    block(*tensors(0))  # plans and allocates
    buffers = [s.buffer.data_ptr() for s in block.steps(tensors(0)) if hasattr(s, "buffer")]
    logs = []
    for step in (1, 2):
        ts = tensors(step)
        want = [t.clone() for t in ts]
        for t in want:
            torch.distributed.all_reduce(t)
        with Log() as log:
            block(*ts)
        assert all(torch.equal(a, b) for a, b in zip(ts, want))
        logs.append(log.ops)
    assert buffers == [s.buffer.data_ptr() for s in block.steps(tensors(0)) if hasattr(s, "buffer")]
    return logs


def test_steady_state_is_one_pack_one_collective_one_unpack_per_dtype():
    for logs in run_ranks(_steady_state, 2, timeout=120):
        copy, reduce = "aten._foreach_copy_", "c10d.allreduce_"
        # float32 (4 tensors) and int64 (2) packed; the lone bfloat16 reduced in place
        assert logs == [[copy, reduce, copy, copy, reduce, copy, reduce]] * 2


def _world_size_one(rank: int, world_size: int, expanded_path: str) -> bool:
    """Under torchrun with one process: the group is made from the environment; values stay."""
    import torch.distributed as dist

    exp = _load(expanded_path, "fused_single_expanded")
    tensors = _tensors(6, 0, 7)
    before = [t.clone() for t in tensors]
    exp.sync_sum(*tensors)
    assert dist.is_initialized() and dist.get_world_size() == 1
    return all(torch.equal(a, b) for a, b in zip(tensors, before))


def _write_modules(tmp_path: Path) -> tuple[str, str]:
    reference = tmp_path / "fused_reference.py"
    expanded = tmp_path / "fused_expanded.py"
    reference.write_text(SOURCE)
    expanded.write_text(expand_source(SOURCE, path="fused_reference.py").code)
    return str(reference), str(expanded)


def test_expanded_block_equals_k_separate_all_reduces_on_two_ranks(tmp_path: Path):
    reference, expanded = _write_modules(tmp_path)
    results = run_ranks(_parity, 2, args=(reference, expanded, 6), timeout=180)
    assert results[0] == results[1]
    dtypes = {d for _, ds in results[0] for d in ds}
    assert dtypes == {str(d) for d in DTYPES}  # every dtype took part
    assert any(len(set(ds)) > 2 for _, ds in results[0])  # mixed dtypes in one block


def test_world_size_one_under_torchrun_environment(tmp_path: Path):
    _, expanded = _write_modules(tmp_path)
    assert run_ranks(_world_size_one, 1, args=(expanded,), timeout=120, init=False) == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (and NCCL)")
def test_a_block_is_captured_in_a_cuda_graph(tmp_path: Path):
    _, expanded = _write_modules(tmp_path)
    assert run_ranks(_cuda_graph, 1, args=(expanded,), timeout=180, init=False) == [True]


def _cuda_graph(rank: int, world_size: int, expanded_path: str) -> bool:
    """World size 1 on NCCL: warm up, capture the block, replay on new values in place."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    exp = _load(expanded_path, "fused_graph_expanded")
    ts = [torch.randn(n, device="cuda") for n in (1, 3, 100, 7, 5)] + [
        torch.arange(4, device="cuda")
    ]  # float32 x 5 and one int64: pack, reduce, unpack and a direct reduce
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # plans, allocates, and warms NCCL up outside the capture
            exp.sync_sum(*ts)
    torch.cuda.current_stream().wait_stream(stream)
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exp.sync_sum(*ts)
    for t in ts:
        t.copy_(torch.arange(t.numel(), device="cuda").view(t.shape).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    same = all(
        torch.equal(t, torch.arange(t.numel(), device="cuda").to(t.dtype)) for t in ts
    )  # world size 1: a sum over one rank leaves the values as they are
    return same and torch.cuda.memory_allocated() == before


def test_without_torchrun_the_block_is_world_size_one(tmp_path: Path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    _, expanded = _write_modules(tmp_path)
    exp = _load(expanded, "fused_serial_expanded")
    tensors = _tensors(6, 0, 11)
    before = [t.clone() for t in tensors]
    exp.sync_sum(*tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert not torch.distributed.is_initialized()
