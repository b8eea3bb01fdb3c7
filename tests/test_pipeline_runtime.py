"""macrogen.runtime.pipeline on real gloo ranks: pipelined training equals the serial run.

The models live here (the runtime reads their forward's source). One spawned run
per layout trains both schedules and checks checkpoints, since spawning costs
more than the checks. Serial references are computed in this process.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from macrogen.pipelining import analysis
from macrogen.pipelining import units as pf
from macrogen.runtime import mesh as meshes
from macrogen.runtime import pipeline as rp
from macrogen.runtime.pipeline_plan import forward_cut
from tests.distributed import run_ranks
from tests.pipeline_units import attach, forward_of

STEPS = 5
BATCH = 8
RTOL, ATOL = 1e-5, 1e-6


def _plan(model, stages, split):
    return forward_cut(model, stages, split, forward_of(type(model)))


def _parse(source):
    return analysis.parse(source).forward


# -- test models -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """The example's GPT, returning logits (the loss is the training loop's)."""

    def __init__(self, n_layer=4, d=32, n_head=4, vocab=64, block_size=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class Wide(nn.Module):
    def __init__(self, d_in, d_out, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x):
        return self.net(x)


class Uneven(nn.Module):
    """A non-uniform block list: widths change and the first block is much heavier."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(
            [Wide(16, 16, 96), Wide(16, 24, 8), nn.Linear(24, 24), Wide(24, 8, 8), nn.Tanh()]
        )
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        """Docstrings are no units."""
        h = torch.tanh(self.inp(x))
        for layer in self.blocks:
            h = layer(h)
        h = h * self.scale
        return self.head(h)


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def uneven_loss(out, y):
    return F.mse_loss(out, y)


def make(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT()
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 64, (BATCH, 17), generator=g)
        return model, data[:, :-1], data[:, 1:], gpt_loss
    model = Uneven()
    g = torch.Generator().manual_seed(1)
    return (
        model,
        torch.randn(BATCH, 6, generator=g),
        torch.randn(BATCH, 3, generator=g),
        uneven_loss,
    )


def train(model, x, y, loss_fn, step, steps=STEPS):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(step(model, x, y, loss_fn).item())
        optimizer.step()
    return losses


def serial(kind: str):
    model, x, y, loss_fn = make(kind)
    losses = train(model, x, y, loss_fn, rp.pipeline_step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the forward as units (no processes) -------------------------------------------------------


def test_plan_balances_the_uneven_blocks_by_parameter_count():
    model, *_ = make("uneven")
    p = _plan(model, 2, None)
    # Wide(16, 16, 96) alone outweighs everything after it: stage 1 starts at the next block
    assert p.describe() == "stage 0: inp, blocks.0 | stage 1: blocks.1-4, scale, head"
    assert p.carried == ["h"]
    assert _plan(model, 3, ("blocks.1", "blocks.3")).describe() == (
        "stage 0: inp, blocks.0 | stage 1: blocks.1-2 | stage 2: blocks.3-4, scale, head"
    )


def test_plan_names_the_gpt_cut():
    model, *_ = make("gpt")
    p = _plan(model, 2, None)
    assert p.describe() == "stage 0: wte, wpe, blocks.0-1 | stage 1: blocks.2-3, lm_head, ln_f"
    assert _plan(model, 2, ("lm_head",)).carried == ["x"]


@pytest.mark.parametrize(
    "split, message",
    [
        (("blocks.9",), "self.blocks has 4 blocks"),
        (("ln_g",), "did you mean 'ln_f'"),
        (("blocks.1", "blocks.2"), "1 name for 2 stages, not 2"),
        (("wte",), "can't start at 'wte': forward still needs idx, pos from before it"),
        (("blocks.0", "T"), "1 name for 2 stages, not 2"),
    ],
)
def test_bad_splits_say_why(split, message):
    model, *_ = make("gpt")
    with pytest.raises(ValueError, match=message):
        _plan(model, 2, split)


def test_more_stages_than_blocks():
    model, *_ = make("gpt")
    with pytest.raises(
        ValueError, match="5 stages but forward's loop over self.blocks has 4 blocks"
    ):
        _plan(model, 5, None)


def test_a_cut_that_carries_two_values():
    source = """
    def forward(self, x, mask):
        h = self.a(x)
        h = self.b(h, mask)
        return self.c(h)
    """
    forward = _parse(source)
    units = forward.units({})
    starts = pf.resolve_split(forward, units, ["b"])
    with pytest.raises(pf.SplitError, match="still needs h, mask"):
        pf.check_cuts(forward, units, starts)


@pytest.mark.parametrize(
    "body, message",
    [
        ("if x.sum() > 0:\n        return self.a(x)\n    return x", "return before the end"),
        ("x = self.a(x)", "must end with `return"),
        (
            "for b in self.blocks:\n        if b is None:\n            break\n        x = b(x)\n    return x",
            "break/continue",
        ),
    ],
)
def test_forwards_that_cannot_be_split(body, message):
    with pytest.raises(pf.SplitError, match=message):
        _parse(f"def forward(self, x):\n    {body}\n")


def test_serial_step_without_a_process_group():
    model, x, y, loss_fn = make("uneven")
    pipe = attach(model, rp.PipelineConfig(stages=2, microbatches=4))
    assert pipe.layout is None  # not launched: the whole model, the serial step
    loss = rp.pipeline_step(model, x, y, loss_fn)
    assert math.isfinite(loss.item()) and model.head.weight.grad is not None


def test_the_pipeline_takes_the_mesh_it_is_given():
    """No mesh is declared ahead of the model: the pipeline is given the program's, and one
    of other stages is refused (the stages and the mesh are made together)."""
    model, *_ = make("uneven")
    config = rp.PipelineConfig(stages=2, microbatches=4)
    cut = forward_cut(model, 2, None, forward_of(type(model)))
    assert rp.attach(model, config, cut, meshes.SERIAL).layout is None  # serial: kept whole
    other = dataclasses.replace(meshes.SERIAL, pipeline_size=3, device_mesh=object())
    with pytest.raises(ValueError) as e:
        rp.attach(model, config, cut, other, where="m.py:3")
    assert str(e.value) == (
        "pipeline at m.py:3: the program's mesh (pipeline, data, tensor) = (3, 1, 1) has 3"
        " pipeline stage(s), and the model is cut into 2: one mesh per program, made with the"
        " pipeline's stages"
    )
    assert not hasattr(rp, "declare") and not hasattr(meshes, "expect_pipeline")


# -- distributed parity ---------------------------------------------------------------------


def _worker(rank, world, cases):
    results = {}
    for kind, schedule in cases:
        meshes.reset()
        model, x, y, loss_fn = make(kind)
        config = rp.PipelineConfig(stages=2, microbatches=4, schedule=schedule)
        if schedule == "interleaved":  # 4 stages, 2 per rank: rank r holds stages r and r + 2
            config = rp.PipelineConfig(4, 4, schedule, stages_per_rank=2)
        pipe = attach(model, config)
        if schedule == "interleaved":
            assert pipe.stages == [rank % 2, rank % 2 + 2]
        lay = pipe.layout
        share = BATCH // lay.data_size  # each data replica trains on its rows
        rows = slice(lay.data_rank * share, (lay.data_rank + 1) * share)
        losses = train(model, x[rows], y[rows], loss_fn, rp.pipeline_step)
        if lay.data_size > 1:  # the batch's loss: the mean of the replicas' (equal shares)
            t = torch.tensor(losses)
            torch.distributed.all_reduce(t, group=lay.data_group)
            losses = (t / lay.data_size).tolist()
        full = rp.full_state_dict(model)
        # a serial checkpoint loads back: perturb, reload, compare
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        rp.load_full_state_dict(model, full)
        reloaded = rp.full_state_dict(model)
        assert all(torch.equal(reloaded[k], full[k]) for k in full)
        results[kind, schedule] = (losses, full, list(model.state_dict()))
    if world == 4:  # 4 ranks don't divide into 3 stages
        meshes.reset()
        try:
            uneven = make("uneven")[0]
            config = rp.PipelineConfig(stages=3, microbatches=4)
            attach(uneven, config, where="m.py:3")
        except ValueError as e:
            results["error"] = str(e)
    return results


def _check(results):
    for rank_result in results:
        for (kind, schedule), (losses, full, local_keys) in rank_result.items():
            ref_losses, ref_state = serial(kind)
            assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), (kind, schedule)
            assert list(full) == list(ref_state)
            for k, v in ref_state.items():
                torch.testing.assert_close(full[k], v, rtol=RTOL, atol=ATOL, msg=f"{schedule} {k}")
            assert len(local_keys) < len(ref_state)  # each rank holds its stage only


def test_two_stages_match_serial():
    """GPipe and 1F1B, on the example-style GPT and on the non-uniform block list."""
    cases = [(kind, s) for kind in ("gpt", "uneven") for s in ("gpipe", "1f1b")]
    _check(run_ranks(_worker, 2, args=(cases,), timeout=300))


def test_interleaved_four_stages_on_two_ranks_match_serial():
    """ScheduleInterleaved1F1B: each rank holds two stages (r and r + 2)."""
    cases = [(kind, "interleaved") for kind in ("gpt", "uneven")]
    _check(run_ranks(_worker, 2, args=(cases,), timeout=300))


def test_interleaving_needs_stages_per_rank_that_fit():
    model, *_ = make("gpt")
    for config, message in [
        (rp.PipelineConfig(4, 4, "1f1b", stages_per_rank=2), "needs schedule='interleaved'"),
        (rp.PipelineConfig(3, 4, "interleaved", stages_per_rank=2), "divides stages (3)"),
        (rp.PipelineConfig(2, 4, "interleaved", stages_per_rank=2), "one pipeline rank"),
        (rp.PipelineConfig(4, 5, "interleaved", stages_per_rank=2), "5 is not a multiple of 2"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            attach(model, config)


def test_two_stages_by_two_data_ranks_match_serial():
    results = run_ranks(_worker, 4, args=([("gpt", "1f1b")],), timeout=300)
    errors = {r.pop("error") for r in results}
    assert errors == {
        "pipeline at m.py:3: world size 4 does not divide into 3 pipeline stages:"
        " launch a multiple of 3 processes (pipeline x data)"
    }
    _check(results)
