"""transformers models through ``mg.parallelize(tp=2, tp_plan="hf")`` against their serial copy.

Float64, 2 gloo ranks, one spawn for every case, shrunk configs (``tests.hf_families``):
losses, every gradient of the first backward (gathered whole) and the parameters after 2 SGD
steps equal to the serial model's.

- **Gemma**: its embedding is ``GemmaTextScaledWordEmbedding`` (an ``nn.Embedding`` whose
  forward multiplies by sqrt(hidden)), vocab-sharded and running its own forward;
- **Qwen3**: the shipped plan's ``replicated_with_grad_allreduce`` per-head q/k norms; and
  whole-model tools on the parallel model: ``num_parameters()``, ``state_dict`` shapes,
  ``clip_grad_norm_``'s norm, ``save_pretrained`` -> ``from_pretrained``;
- **Mixtral** and **Qwen2-MoE**: experts as 3-D parameters (``packed_colwise`` gate_up,
  ``rowwise`` down, ``moe_tp_experts`` around them: the routed sum reduced once); Mixtral also
  with its experts whole per rank (transformers' ``grouped_gemm``: ``shard_experts``).

Mixtral's router computes its softmax in float32 on purpose, so the experts' routing weights'
gradients carry float32's rounding of sums taken in another order across the shards: its
gradients and parameters agree to 1e-7 (relative; measured 9e-10 and 2e-10), every other
case to 1e-10 (measured 4e-17).
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    """
    import macrogen as mg


    def shipped(model):
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="none")


    def experts_whole(model):
        return mg.parallelize(model, tp=2, dp="none", tp_plan={
            "model.embed_tokens": "vocab",
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.experts.gate_up_proj": "shard_experts",
            "model.layers.*.mlp.experts.down_proj": "shard_experts",
            "model.layers.*.mlp.experts": "moe_experts",
            "lm_head": "colwise_gather_output",
        })
    """
)

CASES = {  # name: (model type, the parallelize function, gradient tolerance)
    "gemma": ("gemma", "shipped", 1e-10),
    "qwen3": ("qwen3", "shipped", 1e-10),
    "mixtral": ("mixtral", "shipped", 1e-7),
    "mixtral experts whole": ("mixtral", "experts_whole", 1e-7),
    "qwen2_moe": ("qwen2_moe", "shipped", 1e-10),
}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model):
    from tests.hf_families import _batches

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], None
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if first is None:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                     if p.grad is not None}  # fmt: skip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _gap(ours, theirs):
    return max(float((ours[k] - v).abs().max() / max(1.0, float(v.abs().max())))
               for k, v in theirs.items())  # fmt: skip


def _cases(rank, world, tmp):
    import warnings

    import torch.distributed as dist
    import transformers

    from tests.hf_families import build, families, shrunk_config

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    module = load_module(expand(SOURCE), f"hf_parity_{rank}", Path(tmp))
    by_type = {f.model_type: f for f in families()}
    out = {}
    for name, (model_type, how, _) in CASES.items():
        family = by_type[model_type]
        torch.manual_seed(0)
        serial = build(family, shrunk_config(family))
        reference = copy.deepcopy(serial)
        model = getattr(module, how)(serial)
        want, got = _train(reference), _train(model)
        gaps = {
            "losses": max(abs(a - b) for a, b in zip(got[0], want[0])),
            "gradients": _gap(got[1], want[1]),
            "parameters": _gap(got[2], want[2]),
            "sharded": sum(1 for p in model.parameters() if p.placements[0].is_shard()),
        }
        if name == "qwen3":
            gaps.update(_whole_model(model, reference, Path(tmp), rank, dist))
        out[name] = gaps
    return out


def _whole_model(model, serial, tmp, rank, dist):
    """numel, state_dict, clip_grad_norm_ and save_pretrained see the serial model."""
    ids = torch.arange(16).view(2, 8) % 64
    norms = []
    for m in (model, serial):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    folder = tmp / "qwen3_saved"
    model.save_pretrained(folder, is_main_process=rank == 0)
    dist.barrier()
    loaded = type(serial).from_pretrained(folder, torch_dtype=torch.float64)
    saved = max(float((_full(model.state_dict()[k]) - v).abs().max())
                for k, v in loaded.state_dict().items())  # fmt: skip
    return {
        "numel": model.num_parameters() == serial.num_parameters()
        and sum(p.numel() for p in model.parameters())
        == sum(p.numel() for p in serial.parameters()),
        "state_dict shapes": shapes == {k: tuple(v.shape) for k, v in serial.state_dict().items()},
        "norm": abs(norms[0] - norms[1]) / norms[1],
        "saved": saved,
    }


def test_transformers_families_equal_serial_under_tp2(tmp_path):
    results = run_ranks(_cases, 2, args=(str(tmp_path),), timeout=400)
    assert results[0] == results[1]
    for name, (_, _, tolerance) in CASES.items():
        gaps = results[0][name]
        print(name, gaps)
        assert gaps["losses"] < 1e-10, (name, gaps)
        assert gaps["gradients"] < tolerance, (name, gaps)
        assert gaps["parameters"] < tolerance, (name, gaps)
        assert gaps["sharded"] >= 6, (name, gaps)  # the plan did cut
    qwen3 = results[0]["qwen3"]
    assert qwen3["numel"] and qwen3["state_dict shapes"], qwen3
    assert qwen3["norm"] < 1e-12 and qwen3["saved"] == 0.0, qwen3
