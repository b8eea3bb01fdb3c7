"""``mg.parallelize(model, pp=2)`` on transformers causal LMs equals the serial program.

Each model is built serially from a shrunk config, cut at the pipeline plan its config
ships (the embedding, the decoder layers, the final norm, the head), and trained 3 AdamW
steps through ``mg.pipeline_step(model, x, labels)``, HF's own loss (``labels=``), on
labels that ignore (-100) more positions in some micro-batches than in others. Against
the unexpanded file run serially in this process, in float64: every gradient and every
parameter of ``full_state_dict()`` within 1e-10; the losses within 1e-6, since HF
computes its loss in float32 (``logits.float()``), each micro-batch's tokens summed
apart. Families: Llama (1F1B and GPipe), Qwen2 with ``tie_word_embeddings`` (the
embedding on stage 0 and the head on stage 1 share a weight: its gradients summed over
the pipeline), GPT-NeoX (its own names: ``gpt_neox.embed_in``, ``final_layer_norm``) with
a tokenizer's dict of inputs (``attention_mask`` with left padding). On 4 ranks: Llama
with ``tp=2, tp_plan="hf"`` x ``pp=2``, and ``pp=2`` x 2 data replicas.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    """
    import torch
    import macrogen as mg
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4)


    def build(family):
        if family == "llama":
            return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2))
        if family == "qwen2":
            config = Qwen2Config(**SIZES, num_key_value_heads=2, tie_word_embeddings=True)
            return Qwen2ForCausalLM(config)
        return GPTNeoXForCausalLM(GPTNeoXConfig(**SIZES))


    def parallel(model, variant):
        if variant == "gpipe":
            return mg.parallelize(model, pp=2, microbatches=4, schedule="gpipe")
        if variant == "tp2":  # (and "dp2": pp=2 on 4 ranks, 2 data replicas)
            return mg.parallelize(model, pp=2, tp=2, tp_plan="hf", microbatches=4)
        return mg.parallelize(model, pp=2, microbatches=4)
    """
)
STEPS = 3
BATCH, SEQ = 8, 12
CASES_2 = [("llama", "1f1b"), ("llama", "gpipe"), ("qwen2", "1f1b"), ("neox", "1f1b")]
CASES_4 = [("llama", "tp2"), ("llama", "dp2")]


def _batch(family: str, variant: str):
    """(x, labels): labels ignore each row's first few positions, more in some micro-batches;
    GPT-NeoX's x is a tokenizer's dict with left padding (ignored by labels and mask).
    With data replicas, every row ignores the same count (each replica's mean is the batch's)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    for row in range(BATCH):
        labels[row, : 1 if variant == "dp2" else row % 5] = -100
    if family != "neox":
        return ids, labels
    mask = (labels != -100).long()
    return {"input_ids": ids, "attention_mask": mask}, labels


def _rows(x, rows):
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]


def _train(module, family, variant, serial=False):
    """(losses, gradients after each step, parameters after the last), this rank's share."""
    from macrogen.runtime import mesh as meshes

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = module.build(family)
    model = model if serial else module.parallel(model, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = meshes.mesh() if torch.distributed.is_initialized() else meshes.SERIAL
    x, y = _batch(family, variant)
    share = BATCH // m.data_size
    rows = slice(m.data_rank * share, (m.data_rank + 1) * share)
    x, y = _rows(x, rows), y[rows]
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(module.mg.pipeline_step(model, x, y).detach())
        named = model.named_parameters(remove_duplicate=False)  # a tied weight under each name
        grads.append({n: _full(p.grad) for n, p in named if p.grad is not None})
        opt.step()
    losses = torch.stack(losses)
    if m.data_size > 1:  # the batch's loss: the replicas' mean (equal counts)
        torch.distributed.all_reduce(losses, group=m.data_group)
        losses /= m.data_size
    state = model.full_state_dict() if hasattr(model, "full_state_dict") else model.state_dict()
    torch.set_default_dtype(torch.float32)
    return losses.tolist(), grads, {k: v.detach().clone() for k, v in state.items()}, model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _worker(rank, world, cases, code, directory):
    from macrogen.runtime import mesh as meshes
    from macrogen.runtime import pipeline as rp

    out = {}
    for family, variant in cases:
        meshes.reset()
        module = load_module(code, f"hf_pp_{family}_{variant}_{rank}", Path(directory))
        losses, grads, state, model = _train(module, family, variant)
        out[family, variant] = losses, grads, state, rp.pipeline_of(model).describe()
    return out


def _check(tmp_path, world, cases):
    serial_module = load_module(SOURCE, "hf_pp_serial", tmp_path)
    code = expand(SOURCE)
    results = run_ranks(_worker, world, args=(cases, code, str(tmp_path)), timeout=240)
    for family, variant in cases:
        want_losses, want_grads, want_state, _ = _train(serial_module, family, variant, serial=True)
        seen: list[set] = [set() for _ in range(STEPS)]
        for rank_result in results:
            losses, grads, state, _ = rank_result[family, variant]
            what = f"{family} {variant}"
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), rtol=1e-6, atol=0, msg=what
            )
            assert list(state) == list(want_state), what  # the serial keys, in order
            for k, v in want_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=f"{what} {k}")
            for step, found in enumerate(grads):
                for n, g in found.items():
                    torch.testing.assert_close(
                        g, want_grads[step][n], rtol=1e-10, atol=1e-10, msg=f"{what} {n}"
                    )
                    seen[step].add(n)
        for step in range(STEPS):  # every parameter's gradient was held by some rank
            assert seen[step] == set(want_grads[step]), (family, variant)
    return results


def test_transformers_causal_lms_pipelined_on_two_ranks_equal_serial(tmp_path):
    results = _check(tmp_path, 2, CASES_2)
    assert results[0]["llama", "1f1b"][3] == (
        "stage 0: model.embed_tokens, model.layers.0-1 | stage 1: model.layers.2-3, model.norm,"
        " lm_head"
    )
    assert results[0]["neox", "1f1b"][3] == (
        "stage 0: gpt_neox.embed_in, gpt_neox.layers.0-1 | stage 1: gpt_neox.layers.2-3,"
        " gpt_neox.final_layer_norm, lm_head"
    )


def test_transformers_pipeline_with_tensor_or_data_parallel_on_four_ranks_equals_serial(
    tmp_path,
):
    _check(tmp_path, 4, CASES_4)
