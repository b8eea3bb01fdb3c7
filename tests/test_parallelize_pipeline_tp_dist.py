"""``mg.parallelize(model, pp=2, tp=2, ...)`` on 4 gloo ranks equals the serial program.

A GPT of the tests' own (4 blocks; the embedding vocab-sharded and tied to a
``colwise_gather_output`` head, so the tie spans the two stages and both tensor
shards) is built serially, sharded over the tensor dim, cut into 2 stages by
``mg.parallelize``, and trained 2 AdamW steps through ``mg.pipeline_step``.
Losses, every gradient (each DTensor gathered whole) and every parameter of
``full_state_dict()`` (float64, within 1e-10) equal the unexpanded file's, run
serially in this process; the state dict loads back into a fresh model. One spawn
of 4 ranks (pipeline 2 x data 1 x tensor 2) runs every variant: 1F1B with the
default dp="replicate" over one replica, GPipe with recompute="blocks", interleaved
(4 stages), and 1F1B with dp="fsdp" (over one data rank). On 8 ranks (~10 s on 2
cores: the ranks fork from a preloaded server) pipeline 2 x data 2 x tensor 2 runs 1F1B
with replicate, and with FSDP and recompute (FSDP's shards of the packed qkv are nested
strided ones).
"""

from __future__ import annotations

import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import macrogen as mg

    VOCAB, DIM, HEADS, LAYERS, BLOCK = 64, 32, 4, 4, 16


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head = HEADS
            self.ln_1 = nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.ln_2 = nn.LayerNorm(DIM)
            self.fc = nn.Linear(DIM, 4 * DIM)
            self.out = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)  # (B, T, n_head * hs) each
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))


    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, DIM)
            self.wpe = nn.Embedding(BLOCK, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight  # tied: stage 0 and the last stage hold it

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))


    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


    def parallel(model, variant):
        if variant == "1f1b":
            return mg.parallelize(model, pp=2, tp=2, tp_plan={
                "wte": "vocab",
                "blocks.*.qkv": ("colwise", 3),
                "blocks.*.n_head": "divide",
                "blocks.*.proj": "rowwise",
                "blocks.*.fc": "colwise",
                "blocks.*.out": "rowwise",
                "lm_head": "colwise_gather_output",
            }, microbatches=2)
        if variant == "gpipe":
            return mg.parallelize(model, pp=2, tp=2, tp_plan={
                "wte": "vocab",
                "blocks.*.qkv": ("colwise", 3),
                "blocks.*.n_head": "divide",
                "blocks.*.proj": "rowwise",
                "blocks.*.fc": "colwise",
                "blocks.*.out": "rowwise",
                "lm_head": "colwise_gather_output",
            }, microbatches=2, schedule="gpipe", dp="none", recompute="blocks")
        if variant == "interleaved":  # 4 stages, 2 a rank: the tie spans rank 0's and rank 1's
            return mg.parallelize(model, pp=2, tp=2, tp_plan={
                "wte": "vocab",
                "blocks.*.qkv": ("colwise", 3),
                "blocks.*.n_head": "divide",
                "blocks.*.proj": "rowwise",
                "blocks.*.fc": "colwise",
                "blocks.*.out": "rowwise",
                "lm_head": "colwise_gather_output",
            }, microbatches=2, schedule="interleaved", dp="none")
        if variant == "fsdp":
            return mg.parallelize(model, pp=2, tp=2, tp_plan={
                "wte": "vocab",
                "blocks.*.qkv": ("colwise", 3),
                "blocks.*.n_head": "divide",
                "blocks.*.proj": "rowwise",
                "blocks.*.fc": "colwise",
                "blocks.*.out": "rowwise",
                "lm_head": "colwise_gather_output",
            }, microbatches=2, dp="fsdp")
        if variant == "fsdp recompute":
            return mg.parallelize(model, pp=2, tp=2, tp_plan={
                "wte": "vocab",
                "blocks.*.qkv": ("colwise", 3),
                "blocks.*.n_head": "divide",
                "blocks.*.proj": "rowwise",
                "blocks.*.fc": "colwise",
                "blocks.*.out": "rowwise",
                "lm_head": "colwise_gather_output",
            }, microbatches=2, dp="fsdp", recompute="blocks")
        return model
    """
)
STEPS = 2
BATCH = 4


def _train(module, variant):
    """(losses, full gradients after each step, full state dict after the last): this rank's."""
    from macrogen.runtime import mesh as meshes

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = module.parallel(module.GPT(), variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, module.VOCAB, (BATCH, module.BLOCK + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    m = meshes.mesh() if torch.distributed.is_initialized() else meshes.SERIAL
    share = BATCH // m.data_size
    rows = slice(m.data_rank * share, (m.data_rank + 1) * share)
    x, y = x[rows], y[rows]
    losses, grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(module.mg.pipeline_step(model, x, y, module.loss_fn))
        grads.append(
            {  # a DTensor's whole gradient: a collective over the stage's tensor group
                n: _full(p.grad)
                for n, p in model.named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        )
        optimizer.step()
    state = model.full_state_dict() if hasattr(model, "full_state_dict") else model.state_dict()
    torch.set_default_dtype(torch.float32)
    losses = torch.stack(losses)
    if m.data_size > 1:  # the batch's loss: the replicas' mean
        torch.distributed.all_reduce(losses, group=m.data_group)
        losses /= m.data_size
    return losses.tolist(), grads, {k: v.detach().clone() for k, v in state.items()}


def _full(t):
    # FSDP's shard of a packed colwise shard is gathered by hand (torch permutes its rows);
    # a copy: a replicated DTensor's whole tensor is its local one, a view into the gradient
    # buckets that the next step overwrites
    from macrogen.runtime.dtensor_whole import full_tensor

    return (full_tensor(t) if hasattr(t, "full_tensor") else t).detach().clone()


def _worker(rank, world, variants, code, directory):
    from macrogen.runtime import mesh as meshes
    from macrogen.runtime import pipeline as rp

    out = {}
    for variant in variants:
        meshes.reset()
        module = load_module(code, f"pptp_{variant}_{rank}", Path(directory))
        losses, grads, state = _train(module, variant)
        # the state dict round-trips: a fresh model, cut and sharded, loads it and gives it back
        torch.set_default_dtype(torch.float64)
        whole = module.GPT()
        layers = [weakref.ref(m) for b in whole.blocks for m in b.modules()]  # blocks and layers
        fresh = module.parallel(whole, variant)
        del whole
        # the other stage's blocks are gone at once: nothing (a list of the model's modules, a
        # colwise check's list) keeps them, nor a cycle (a planned layer's forward) until a gc
        # pass: their shards would count in the stage's memory
        alive = sum(m() is not None for m in layers)
        assert alive == len(layers) // 2, (variant, alive)  # this stage's 2 of 4 blocks
        fresh.load_full_state_dict(state)
        again = fresh.full_state_dict()
        torch.set_default_dtype(torch.float32)
        assert list(again) == list(state)
        for k, v in state.items():
            assert torch.equal(again[k], v), k
        pipe = rp.pipeline_of(fresh)
        assert pipe.fully_sharded == variant.startswith("fsdp")
        out[variant] = (losses, grads, state, pipe.describe())
    return out


def _check(tmp_path, world, variants):
    serial = load_module(SOURCE, "pptp_serial", tmp_path)
    want_losses, want_grads, want_state = _train(serial, "serial")
    code = expand(SOURCE)
    results = run_ranks(_worker, world, args=(variants, code, str(tmp_path)), timeout=240)
    for variant in variants:
        seen: list[set[str]] = [set() for _ in range(STEPS)]
        for rank_result in results:
            losses, grads, state, described = rank_result[variant]
            if variant != "interleaved":
                assert described == (
                    "stage 0: wte, wpe, blocks.0-1 | stage 1: blocks.2-3, lm_head, ln_f"
                )
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=1e-10
            )
            assert list(state) == list(want_state)  # the serial keys, both names of the tie
            for k, v in want_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=variant + k)
            for step, found in enumerate(grads):
                for n, gr in found.items():
                    torch.testing.assert_close(
                        gr, want_grads[step][n], rtol=1e-10, atol=1e-10, msg=f"{variant} {n}"
                    )
                    seen[step].add(n)
        for step in range(STEPS):  # every parameter's gradient was held by some rank
            assert seen[step] == set(want_grads[step]), variant


def test_pp2_by_tp2_on_four_ranks_equals_the_serial_program(tmp_path):
    _check(tmp_path, 4, ["1f1b", "gpipe", "interleaved", "fsdp"])


def test_a_colwise_output_sent_to_the_loss_is_an_error_naming_the_layer():
    """The last stage sends a colwise layer's output (this rank's slice of the features) on:
    the check ``apply_tensor_parallel`` puts on the model's forward, on the stage module."""
    import weakref

    import torch.nn as nn

    from macrogen.runtime import parallelize as rt

    head, model = nn.Linear(2, 2), nn.Module()
    model.__dict__[rt._COLWISE] = [("lm_head", head)]

    class Stage(nn.Module):
        def forward(self, x):
            out = x * 2
            head.__dict__[rt._LAST_OUTPUT] = weakref.ref(out)  # as the colwise forward keeps it
            return out if x.sum() > 0 else out + 1

    stage = Stage()
    rt.check_outputs(model, stage, where="t.py:3")
    stage(-torch.ones(2))  # another tensor: fine
    with pytest.raises(rt.PlanError, match="lm_head is colwise.*colwise_gather_output"):
        stage(torch.ones(2))


def test_pp2_by_dp2_by_tp2_on_eight_ranks_equals_the_serial_program(tmp_path):
    _check(tmp_path, 8, ["1f1b", "fsdp recompute"])
