"""nanoGPT's GPT as written, pipelined: the expanded program equals the unexpanded one.

The model is tests/golden/pipeline_tied_cut/input.py: a ``transformer``
ModuleDict holding the blocks' ModuleList, ``wte`` tied to ``lm_head`` across
the cut, and a forward that computes its own loss (``logits, loss = model(x,
y)``). Each case expands a variant of that file, trains 5 steps with
``mg.pipeline_step(model, X, Y)`` (SGD with momentum) and compares the losses,
every parameter (both names of the tied one) and the serial-format checkpoint
with the unexpanded file run serially in this process.

Two spawns keep CI short: 2 ranks (1F1B fp32; interleaved 4 stages fp64,
balanced at run time; GPipe fp32 with a loss_fn on forward's tuple) and 4
ranks, pipeline 2 x data 2 (1F1B fp32 with @data_parallel stacked;
interleaved fp64). Tolerances: fp32 rtol 1e-5, atol 1e-6 (micro-batches sum
the gradients in another order than the serial batch); fp64 1e-10.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import macrogen as mg
from macrogen.runtime import mesh as meshes
from macrogen.runtime import pipeline as rp
from tests.distributed import run_ranks
from tests.helpers import load_module

GOLDEN = Path(__file__).parent / "golden" / "pipeline_tied_cut" / "input.py"
STEPS = 5
BATCH = 8
TOL = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-10)}
DECORATOR = '@mg.pipeline(stages=2, microbatches=4, schedule="1f1b", split=["transformer.h.2"])'
VARIANTS = {
    "1f1b": DECORATOR,
    "interleaved": '@mg.pipeline(stages=4, microbatches=4, schedule="interleaved")',
    "gpipe": DECORATOR.replace('"1f1b"', '"gpipe"'),
    "1f1b+data": "@mg.data_parallel(bucket_mb=1)\n" + DECORATOR,
}


def last_position_loss(logits, y):
    """nanoGPT's forward without targets: the logits of the last position only."""
    return F.cross_entropy(logits.flatten(0, 1), y[:, -1])


def _source(variant: str) -> str:
    source = GOLDEN.read_text()
    assert DECORATOR in source
    return source.replace(DECORATOR, VARIANTS[variant])


def _train(module, dtype: str, with_loss_fn: bool):
    torch.set_default_dtype(getattr(torch, dtype))
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (BATCH, 17), generator=g)
    X, Y = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # as nanoGPT's get_batch
    pipe = rp.pipeline_of(model)
    lay = pipe.layout if pipe is not None else None
    if lay is not None and lay.data_size > 1:  # each data replica trains on its rows
        share = BATCH // lay.data_size
        rows = slice(lay.data_rank * share, (lay.data_rank + 1) * share)
        X, Y = X[rows], Y[rows]
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if with_loss_fn:  # forward's tuple: its first element goes to the loss
            loss = mg.pipeline_step(model, X, Y, last_position_loss)
        else:
            loss = mg.pipeline_step(model, X, Y)  # forward computes the loss
        optimizer.step()
        losses.append(loss.item())
    if lay is not None and lay.data_size > 1:  # the batch's loss: the replicas' mean
        t = torch.tensor(losses)
        torch.distributed.all_reduce(t, group=lay.data_group)
        losses = (t / lay.data_size).tolist()
    full = model.full_state_dict() if pipe is not None else model.state_dict()
    full = {k: v.detach().clone() for k, v in full.items()}
    torch.set_default_dtype(torch.float32)
    return losses, full, model


def _worker(rank, world, cases, directory):
    sys.path.insert(0, directory)
    results = {}
    for variant, dtype, expanded in cases:
        meshes.reset()
        module = load_module(expanded, f"nanogpt_{variant}_{dtype}_{rank}", Path(directory))
        losses, full, model = _train(module, dtype, variant == "gpipe")
        pipe = rp.pipeline_of(model)
        # the tied tensor: the stages holding it kept it one tensor, and a reload keeps it so
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        model.load_full_state_dict(full)
        reloaded = model.full_state_dict()
        assert all(torch.equal(reloaded[k], full[k]) for k in full)
        tied = [(name, sorted(stages)) for name, stages in pipe.cut.tied]
        results[variant, dtype] = (losses, full, tied, pipe.describe(), len(pipe.tied))
    return results


def _run(tmp_path, world, cases):
    serial = {}
    for variant, dtype in cases:
        module = load_module(_source(variant), f"serial_nanogpt_{variant}_{dtype}", tmp_path)
        serial[variant, dtype] = _train(module, dtype, variant == "gpipe")[:2]
    expanded = [(v, d, mg.expand_source(_source(v), path=str(GOLDEN)).code) for v, d in cases]
    results = run_ranks(_worker, world, args=(expanded, str(tmp_path)), timeout=600)
    for rank_result in results:
        for (variant, dtype), (losses, full, tied, _, _) in rank_result.items():
            ref_losses, ref_state = serial[variant, dtype]
            rtol, atol = TOL[dtype]
            assert losses == pytest.approx(ref_losses, rel=rtol, abs=atol), (variant, dtype)
            assert list(full) == list(ref_state)  # the serial keys: both names of the tie
            for k, v in ref_state.items():
                assert full[k].dtype == v.dtype
                torch.testing.assert_close(full[k], v, rtol=rtol, atol=atol, msg=f"{variant} {k}")
            assert torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])
            stages = 4 if variant == "interleaved" else 2
            assert tied == [("lm_head.weight", [0, stages - 1])]
    return results


def test_nanogpt_on_two_ranks_matches_the_unexpanded_file(tmp_path):
    cases = [("1f1b", "float32"), ("interleaved", "float64"), ("gpipe", "float32")]
    results = _run(tmp_path, 2, cases)
    for rank_result in results:
        assert rank_result["1f1b", "float32"][3] == (
            "stage 0: transformer.wte, transformer.wpe, transformer.h.0-1"
            " | stage 1: transformer.h.2-3, transformer.ln_f, lm_head"
        )
        assert rank_result["interleaved", "float64"][3] == (  # balanced: a block a stage
            "stage 0: transformer.wte, transformer.wpe, transformer.h.0"
            " | stage 1: transformer.h.1 | stage 2: transformer.h.2"
            " | stage 3: transformer.h.3, transformer.ln_f, lm_head"
        )
        # every rank holds the tied tensor: rank 0 in stage 0, rank 1 in the last stage
        assert all(held == 1 for *_, held in rank_result.values())


def test_nanogpt_pipeline_by_data_on_four_ranks_matches_the_unexpanded_file(tmp_path):
    _run(tmp_path, 4, [("1f1b+data", "float32"), ("interleaved", "float64")])
