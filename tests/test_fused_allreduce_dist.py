"""fused_allreduce parity: the expanded block against the unexpanded one (K all_reduce calls).

Both run on the same random tensors on 2 gloo ranks: random shapes (0-d,
empty, ragged), non-contiguous views, float32/float64/int64/bfloat16 mixed in
one block, op SUM and MAX, with and without ``group=``. Results must be equal
bit for bit (each element is reduced by the same collective either way), and
the expanded block must issue one collective per dtype.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
            assert collectives == len({t.dtype for t in tensors}), (name, trial, collectives)
            checked.append((name, [str(t.dtype) for t in tensors]))
    return checked


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
