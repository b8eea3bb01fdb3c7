"""``mg.parallelize(model, dp="fsdp")``: torch's FSDP2 on the models people train, against serial.

Checked after 5 AdamW steps in float32 (1e-5), each rank training on its share of
the batch: FSDP on 2 and 4 ranks and HSDP 2 x 2, on transformers'
``LlamaForCausalLM`` and on a nanoGPT-shaped model (blocks in a ModuleDict's
ModuleList, tied embedding and head, the parent re-initializing its children);
hand-written FSDP2 on the same weights gives the same bits; torch's
``clip_grad_norm_`` gives the serial norm; ``accumulate=2`` equals the serial
loop's two micro-batches; ``save_pretrained`` on every rank writes a folder that
``from_pretrained`` loads equal to the model (FSDP, HSDP, FSDP x TP, and GPT-2's
packed, tied layers under FSDP x TP); and the errors a user can make are named.
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
    import collections
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import macrogen as mg

    VOCAB = 96
    Output = collections.namedtuple("Output", "loss")


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.ln(x))))


    class GPT(nn.Module):
        def __init__(self, dim=32, layers=3):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(VOCAB, dim),
                h=nn.ModuleList([Block(dim) for _ in range(layers)]),
                ln_f=nn.LayerNorm(dim),
            ))
            self.lm_head = nn.Linear(dim, VOCAB, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied
            for name, p in self.named_parameters():  # the parent re-initializes its children
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

        def forward(self, input_ids, labels):
            x = self.transformer.wte(input_ids)
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            return Output(loss)  # (a pytree FSDP looks into: a namedtuple, as HF's ModelOutput)


    def gpt():
        return GPT()


    def llama():
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


    def gpt2():
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32))


    def fsdp(model):
        return mg.parallelize(model, dp="fsdp")


    def fsdp_tp_gpt2(model):  # a packed qkv (HF Conv1D), the embedding tied to the head
        return mg.parallelize(model, tp=2, dp="fsdp", tp_plan={
            "transformer.h.*.attn.c_attn": ("colwise", 3),
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.attn.split_size": "divide",
            "transformer.h.*.attn.num_heads": "divide",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
        })


    def hsdp(model):
        return mg.parallelize(model, dp="fsdp", dp_replicate=2)


    def fsdp_accumulating(model):
        return mg.parallelize(model, dp="fsdp", accumulate=2, reshard_after_forward=False)


    def fsdp_tp_llama(model):  # FSDP x TP on one 2-D mesh, TP first (torchtitan's order)
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="fsdp")


    def fsdp_tp_gpt(model):
        return mg.parallelize(model, tp=2, dp="fsdp", tp_plan={
            "transformer.h.*.fc": "colwise", "transformer.h.*.proj": "rowwise"})


    def fsdp_units(model):
        return mg.parallelize(model, dp="fsdp", shard_units=["transformer.nothing.*"])
    """
)

STEPS, BATCH, SEQ = 5, 4, 12


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, vocab, rows, micro=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)[rows]
        for part in ids.chunk(micro):
            (model(input_ids=part, labels=part).loss / micro).backward()
        norms.append(float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6))))
        opt.step()
        opt.zero_grad()
    state = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
    return state, norms


def _parity(rank, world, tmp, kind, wrap, micro):
    import torch.distributed as dist

    module = load_module(expand(SOURCE), f"fsdp_{kind}_{wrap}_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = getattr(module, kind)()
    ref, ref_norms = _train(serial, module.VOCAB, slice(None), micro)

    import macrogen as mg

    torch.manual_seed(0)
    model = getattr(module, wrap)(getattr(module, kind)())
    data = mg.mesh(model)  # the mesh it was parallelized on
    share = BATCH // data.data_size
    rows = slice(data.data_rank * share, (data.data_rank + 1) * share)
    ours, norms = _train(model, module.VOCAB, rows, micro)
    # FSDP x TP sums gradients in two steps (tensor, then data): Adam's normalization makes that
    # reordering up to ~2e-5 in a few parameters with near-zero gradients
    atol = 2e-5 if "_tp_" in wrap else 1e-5
    for key, value in ref.items():
        torch.testing.assert_close(
            ours[key], value, rtol=0, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    if kind == "llama":  # every rank calls save_pretrained, as for transformers' own FSDP
        _assert_saves_whole(model, ours, Path(tmp) / wrap, rank)

    if wrap == "fsdp":  # hand-written FSDP2 on the same weights: the same bits
        from torch.distributed.fsdp import fully_shard

        from macrogen.runtime.blocks import repeated_layers
        from macrogen.runtime.mesh import mesh

        torch.manual_seed(0)
        theirs = getattr(module, kind)()
        for _, unit in repeated_layers(theirs):
            fully_shard(unit, mesh=mesh().device_mesh)
        fully_shard(theirs, mesh=mesh().device_mesh)
        by_hand, _ = _train(theirs, module.VOCAB, rows, micro)
        for key, value in by_hand.items():
            assert torch.equal(ours[key], value), key
    dist.barrier()
    return local, total


@pytest.mark.parametrize(
    "kind, wrap, world, micro",
    [
        ("gpt", "fsdp", 2, 1),
        ("llama", "fsdp", 2, 1),
        ("gpt", "fsdp", 4, 1),
        ("llama", "hsdp", 4, 1),
        ("gpt", "fsdp_accumulating", 2, 2),
        ("llama", "fsdp_tp_llama", 4, 1),
        ("gpt", "fsdp_tp_gpt", 4, 1),
    ],
)
def test_fully_sharded_matches_serial(tmp_path, kind, wrap, world, micro):
    results = run_ranks(_parity, world, args=(str(tmp_path), kind, wrap, micro), timeout=400)
    local, total = results[0]
    # HSDP: sharded within halves; FSDP x TP: what TP does not split is sharded 2 ways only
    shards = world // 2 if wrap == "hsdp" or "_tp_" in wrap else world
    assert local <= total // shards + 64 * shards  # 1/world of the parameters (rows rounded up)


def _assert_saves_whole(model, state, folder, rank):
    """``model.save_pretrained`` on every rank: ``from_pretrained`` loads ``state`` bit for bit."""
    import torch.distributed as dist

    model.save_pretrained(folder, is_main_process=rank == 0)
    dist.barrier()
    loaded = type(model).from_pretrained(folder, dtype=torch.float32).state_dict()
    assert loaded.keys() == state.keys()
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key


def _save_packed(rank, world, tmp):
    """GPT-2 under FSDP x TP (packed qkv, tied head) saved before training: the serial weights."""
    module = load_module(expand(SOURCE), f"fsdp_save_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = {k: v.clone() for k, v in module.gpt2().state_dict().items()}
    torch.manual_seed(0)
    model = module.fsdp_tp_gpt2(module.gpt2())
    _assert_saves_whole(model, serial, Path(tmp) / "gpt2", rank)
    return True


def test_save_pretrained_of_fsdp_x_tp_with_a_packed_layer_writes_the_serial_weights(tmp_path):
    assert run_ranks(_save_packed, 4, args=(str(tmp_path),), timeout=300) == [True] * 4


def _errors(rank, world, tmp):
    import torch.nn as nn

    module = load_module(expand(SOURCE), f"fsdp_errors_{rank}", Path(tmp))
    with pytest.raises(ValueError, match=r"shard_units: 'transformer.nothing.\*' matches no submodule of GPT"):  # fmt: skip
        module.fsdp_units(module.gpt())
    model = module.fsdp(module.gpt())
    from macrogen.runtime.zero import shard_optimizer

    # (in one file with dp="fsdp", mg.shard_optimizer is an expansion error: tests/macros/
    # test_data_parallel_shard_full.py; from another file, the run refuses it)
    with pytest.raises(ValueError, match=r"shard_optimizer is redundant"):
        shard_optimizer(torch.optim.AdamW(model.parameters()), where="other.py:3")
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"parameters are on the meta device .*to_empty"):
        module.fsdp(meta)
    return True


def test_fully_sharded_errors_are_named(tmp_path):
    assert run_ranks(_errors, 2, args=(str(tmp_path),), timeout=200) == [True, True]
