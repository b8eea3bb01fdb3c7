"""``mg.parallelize(recompute="blocks")`` with tensor parallelism and FSDP, against the serial model.

Two gloo ranks, float64, 3 AdamW steps: transformers' Llama (the plan it ships,
tp=2: each recomputed layer runs its all-reduces again) and a GPT-style model
of the tests' own under FSDP (its hooks gather each unit again for the
recompute). Losses, the first gradients and the final parameters match the
serial program within 1e-10.
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
    import torch.nn as nn
    import torch.nn.functional as F
    import macrogen as mg
    from transformers import LlamaConfig, LlamaForCausalLM

    VOCAB = 64


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))


    class GPT(nn.Module):
        def __init__(self, dim=32, layers=3):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, dim)
            self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
            self.out = nn.Linear(dim, VOCAB, bias=False)
            self.out.weight = self.tok.weight  # tied

        def forward(self, input_ids, labels):
            x = self.tok(input_ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.out(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
            return {"logits": logits, "loss": loss}


    class Hidden(GPT):
        def forward(self, input_ids, labels):  # an object FSDP's pytree can't look into
            return type("Out", (), {"loss": super().forward(input_ids, labels)["loss"]})()


    def llama():
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        return LlamaForCausalLM(config)


    def gpt():
        return GPT()


    def parallel_llama(model):
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="none", recompute="blocks")


    def parallel_gpt(model):
        return mg.parallelize(model, dp="fsdp", recompute="blocks")


    def hidden():
        return Hidden()


    def parallel_hidden(model):
        return mg.parallelize(model, dp="fsdp")
    """
)
STEPS, BATCH, SEQ = 3, 4, 16


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rows):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, first = [], None
    for step in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=gen)[rows]
        torch.manual_seed(100 + step)  # dropout's mask: the same on every rank and serially
        loss = model(input_ids=ids, labels=ids)["loss"]  # HF's ModelOutput, or a dict
        loss.backward()
        if first is None:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first


def _parity(rank, world, tmp, kind):
    import macrogen as mg

    torch.set_default_dtype(torch.float64)
    unexpanded = load_module(SOURCE, f"serial_rc_{kind}_{rank}", Path(tmp))
    module = load_module(expand(SOURCE), f"expanded_rc_{kind}_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = getattr(unexpanded, kind)()
    torch.manual_seed(0)
    model = getattr(module, f"parallel_{kind}")(getattr(module, kind)())
    mesh = mg.mesh(model)  # the mesh it was parallelized on
    share = BATCH // mesh.data_size
    rows = slice(mesh.data_rank * share, (mesh.data_rank + 1) * share)
    if kind == "gpt":  # dropout draws per row: the data ranks' shares differ from serial's
        for block in list(serial.layers) + list(model.layers):
            block.drop.p = 0.0
    losses, grads = _train(model, rows)
    ref_losses, ref_grads = _train(serial, slice(None))
    if mesh.data_size == 1:
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-10, msg=name)
    final = {k: _full(v) for k, v in model.state_dict().items()}
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-10, msg=key)
    recomputed = [getattr(b.forward, "_mg_recomputed", False) for b in _blocks(model)]
    return all(recomputed) and len(recomputed) >= 2


def _blocks(model):
    from macrogen.runtime.blocks import repeated_layers

    return [b for _, b in repeated_layers(model)]


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_recompute_matches_serial_on_two_ranks(tmp_path, kind):
    assert all(run_ranks(_parity, 2, args=(str(tmp_path), kind), timeout=300))


def _hidden_outputs(rank, world, tmp):
    module = load_module(expand(SOURCE), f"expanded_hidden_{rank}", Path(tmp))
    model = module.parallel_hidden(module.hidden())
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError) as e:
        model(input_ids=ids, labels=ids)
    return str(e.value)


def test_fsdp_outputs_it_cannot_see_are_an_error_at_the_forward(tmp_path):
    message = run_ranks(_hidden_outputs, 2, args=(str(tmp_path),), timeout=120)[0]
    assert "Hidden.forward returned a Out whose tensors (loss) FSDP cannot see" in message
