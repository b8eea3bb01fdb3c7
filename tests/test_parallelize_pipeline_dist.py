"""``mg.parallelize(model, pp=2, microbatches=4)`` on gloo ranks equals the serial program.

A GPT of the tests' own (4 blocks, the embedding tied to the head) is built
serially, then cut at run time by ``mg.parallelize``, and trained 3 AdamW steps
through ``mg.pipeline_step``. Losses, every gradient and every parameter (float64,
within 1e-10) equal the unexpanded file's, run serially in this process. One spawn
per world size: 2 ranks (1F1B with the default dp="replicate" over one replica,
GPipe, interleaved, the blocks recomputed, ``pipeline_step(torch.compile(model), ...)``:
the schedule runs, and one warning says the stages run eagerly; and the GPT built on the meta
device with ``init="model"``, against the unexpanded file's whole meta model initialized
serially: each rank initializes its own stage, the tied weight on both), 4 ranks (pipeline 2 x data 2: replicate,
FSDP with and without recompute, and ZeRO-1 with ``mg.shard_optimizer``, whose
``.grad`` stays each replica's own: losses and parameters). Replicate all-reduces a
step's gradients once, not once per micro-batch.
"""

from __future__ import annotations

import collections
import textwrap
import warnings
from pathlib import Path

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
            self.ln_1 = nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.ln_2 = nn.LayerNorm(DIM)
            self.fc = nn.Linear(DIM, 4 * DIM)
            self.out = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
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
            return mg.parallelize(model, pp=2, microbatches=4)
        if variant == "gpipe":
            return mg.parallelize(model, pp=2, microbatches=2, schedule="gpipe", dp="none")
        if variant == "interleaved":
            return mg.parallelize(model, pp=2, microbatches=4, schedule="interleaved", dp="none")
        if variant == "fsdp":
            return mg.parallelize(model, pp=2, microbatches=4, dp="fsdp")
        if variant == "zero1":
            return mg.parallelize(model, pp=2, microbatches=4, dp="zero1")
        if variant == "recompute":
            return mg.parallelize(model, pp=2, microbatches=4, recompute="blocks")
        if variant == "fsdp_recompute":
            return mg.parallelize(model, pp=2, microbatches=4, dp="fsdp", recompute="blocks")
        if variant == "compiled":
            return mg.parallelize(model, pp=2, microbatches=4)
        if variant == "meta":  # unexpanded: the whole meta model initialized serially
            return mg.parallelize(model, pp=2, microbatches=4, init="model")
        return model


    def build(variant):
        if variant == "meta":  # each rank allocates and initializes its own stage only
            with torch.device("meta"):
                return GPT()
        return GPT()


    def stepped(model, variant):  # what the loop hands pipeline_step (nanoGPT compiles it)
        return torch.compile(model, backend="eager") if variant == "compiled" else model


    def optimizer(model, variant):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return mg.shard_optimizer(opt) if variant == "zero1" else opt
    """
)
STEPS = 3
BATCH = 8


def _train(module, variant, told=None):
    """(losses, gradients after each step, parameters after the last): this rank's share;
    ``told``: the warnings about a compiled model pipeline_step gave."""
    from macrogen.runtime import mesh as meshes

    told = [] if told is None else told
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = module.parallel(module.build(variant), variant)
    optimizer = module.optimizer(model, variant)
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = module.mg.pipeline_step(module.stepped(model, variant), x, y, module.loss_fn)
        told.extend(str(w.message) for w in caught if "torch.compile" in str(w.message))
        grads.append(
            {
                n: _full(p.grad)
                for n, p in model.named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        )
        optimizer.step()
        losses.append(loss)
    losses = torch.stack(losses)
    if m.data_size > 1:  # the batch's loss: the replicas' mean
        torch.distributed.all_reduce(losses, group=m.data_group)
        losses /= m.data_size
    if hasattr(model, "full_state_dict"):
        state = model.full_state_dict()
    else:
        state = model.state_dict()
    torch.set_default_dtype(torch.float32)
    return losses.tolist(), grads, {k: v.detach().clone() for k, v in state.items()}, model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _worker(rank, world, variants, code, directory):
    from macrogen.runtime import buckets, zero
    from macrogen.runtime import mesh as meshes
    from macrogen.runtime import pipeline as rp

    launches = []  # the buckets' all-reduces (replicate) and reduce-scatters (zero1)
    for cls, name in ((buckets.Bucket, "launch"), (zero.ShardBucket, "launch_reduce")):
        counted = getattr(cls, name)
        setattr(cls, name, _counting(counted, launches))
    out = {}
    for variant in variants:
        meshes.reset()
        launches.clear()
        module = load_module(code, f"pp_{variant}_{rank}", Path(directory))
        told: list[str] = []
        losses, grads, state, model = _train(module, variant, told)
        recomputed = sum(
            getattr(m.__dict__.get("forward"), "_mg_recomputed", False) for m in model.modules()
        )
        reduces = sorted(collections.Counter(launches).values())  # launches per bucket
        described = rp.pipeline_of(model).describe()
        out[variant] = (losses, grads, state, described, recomputed, reduces, told)
    return out


def _counting(launch, launches):
    def counted(self, *args, **kwargs):
        launches.append(id(self))
        return launch(self, *args, **kwargs)

    return counted


def _check(tmp_path, world, variants):
    serial = load_module(SOURCE, "pp_serial", tmp_path)
    references = {v: _train(serial, v) for v in {"meta" if v == "meta" else "serial"
                                                  for v in variants}}  # fmt: skip
    code = expand(SOURCE)
    results = run_ranks(_worker, world, args=(variants, code, str(tmp_path)), timeout=120)
    for variant in variants:
        want_losses, want_grads, want_state, _ = references[
            variant if variant == "meta" else "serial"
        ]
        seen: list[dict] = [{} for _ in range(STEPS)]
        for rank_result in results:
            losses, grads, state, _, recomputed, _, told = rank_result[variant]
            assert len(told) == (variant == "compiled"), told  # stages run eagerly: said once
            assert recomputed == (2 if "recompute" in variant else 0), variant  # this stage's
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), rtol=1e-10, atol=1e-10
            )
            assert list(state) == list(want_state)  # the serial keys, both names of the tie
            for k, v in want_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=variant + k)
            if variant == "zero1":  # .grad is this replica's: the optimizer reduce-scatters it
                continue
            for step, found in enumerate(grads):
                for n, gr in found.items():
                    torch.testing.assert_close(
                        gr, want_grads[step][n], rtol=1e-10, atol=1e-10, msg=f"{variant} {n}"
                    )
                    seen[step][n] = True
        for step in range(STEPS):  # every parameter's gradient was held by some rank
            assert variant == "zero1" or set(seen[step]) == set(want_grads[step]), variant
    return results


def test_pp2_on_two_ranks_equals_the_serial_program(tmp_path):
    results = _check(tmp_path, 2, ["1f1b", "gpipe", "interleaved", "recompute", "compiled", "meta"])
    assert results[0]["1f1b"][3] == (
        "stage 0: wte, wpe, blocks.0-1 | stage 1: blocks.2-3, lm_head, ln_f"
    )
    assert results[0]["interleaved"][3].count("stage") == 4


def test_pp2_by_dp2_on_four_ranks_equals_the_serial_program(tmp_path):
    results = _check(tmp_path, 4, ["1f1b", "fsdp", "zero1", "fsdp_recompute"])
    # replicate and zero1 reduce a step's gradients once, after its 4 micro-batches' backwards
    # (each backward all-reduced them before, and zero1 sent the first one's for nothing)
    for rank_result in results:
        for variant in ("1f1b", "zero1"):
            per_bucket = rank_result[variant][5]
            assert per_bucket and set(per_bucket) == {STEPS}, (variant, per_bucket)
