"""@tensor_parallel on a model written as people write them (nanoGPT's shape, Hugging Face's post_init).

The model below is written for these tests, in nanoGPT's style: blocks under a
``ModuleDict`` and a ``ModuleList``, the parent re-initializing every
``nn.Linear`` through ``self.apply`` and re-drawing ``c_proj.weight`` by name
after its children are built, an attention ``forward`` that takes its width
from the input (``B, T, C = x.size()``, ``C // self.n_head``, ``.view(B, T,
C)``), tied embedding and head, and nanoGPT's ``configure_optimizers``
parameter groups. Nothing in it is edited for tensor parallelism.

Checked on 2 ranks (TP=2) and on 4 (DP=2 x TP=2): the initial weights equal the
serial ones exactly; the losses and parameters after 3 AdamW steps equal
serial (1e-3: Adam amplifies rounding on near-zero gradients); one block's
forward, input gradient and parameters after 3 AdamW steps equal serial and
torch's own tensor parallelism on the same weights (tightly).
"""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, expansion_errors, load_module

SOURCE = textwrap.dedent(
    '''
    import math
    from dataclasses import dataclass

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg


    @dataclass
    class Config:
        vocab_size: int = 64
        block_size: int = 16
        n_layer: int = 2
        n_head: int = 4
        n_embd: int = 32


    @mg.tensor_parallel(
        plan={"c_attn": ("colwise", 3), "c_proj": "rowwise", "n_head": "divide", "n_embd": "divide"}
    )
    class SelfAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd)
            self.n_head = config.n_head
            self.n_embd = config.n_embd

        def forward(self, x):
            B, T, C = x.size()  # batch, time, channels
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)


    @mg.tensor_parallel(plan={"c_fc": "colwise", "c_proj": "rowwise"})
    class FeedForward(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))


    class Layer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.ln_1 = nn.LayerNorm(config.n_embd)
            self.attn = SelfAttention(config)
            self.ln_2 = nn.LayerNorm(config.n_embd)
            self.mlp = FeedForward(config)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))


    @mg.tensor_parallel(plan={"transformer.wte": "vocab", "lm_head": "colwise"})
    class LanguageModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config.vocab_size, config.n_embd),
                    wpe=nn.Embedding(config.block_size, config.n_embd),
                    h=nn.ModuleList([Layer(config) for _ in range(config.n_layer)]),
                    ln_f=nn.LayerNorm(config.n_embd),
                )
            )
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
            # re-initialize every child, then the residual projections by name
            self.apply(self._init_weights)
            for pn, p in self.named_parameters():
                if pn.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

        def configure_optimizers(self, weight_decay, learning_rate):
            param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
            decay = [p for n, p in param_dict.items() if p.dim() >= 2]
            nodecay = [p for n, p in param_dict.items() if p.dim() < 2]
            groups = [
                {"params": decay, "weight_decay": weight_decay},
                {"params": nodecay, "weight_decay": 0.0},
            ]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


    @mg.data_parallel()
    class DataParallelLM(LanguageModel):
        pass


    class PreTrained(nn.Module):
        """Hugging Face's pattern: the subclass builds its layers, then calls post_init()."""

        def post_init(self):
            self.apply(self._init_weights)

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(mean=0.0, std=0.5)
                if module.bias is not None:
                    module.bias.data.uniform_(-1, 1)


    # decorated (nothing of its own to shard): its construction's end, after post_init(), is
    # where the shards of the layers it builds are cut
    @mg.tensor_parallel(plan={})
    class HFModel(PreTrained):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList([FeedForward(config) for _ in range(config.n_layer)])
            self.post_init()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    '''
)

CONFIG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16)
BATCH, STEPS, LR = 4, 3, 1e-2
# Adam's normalized step moves a parameter by about lr (at most ~1.5 lr in 3 steps of
# betas 0.9/0.999) per step whatever its gradient; two runs, each either way
ADAM_NOISE = 2 * STEPS * 1.5 * LR
SERIAL_TOL = dict(rtol=1e-3, atol=1e-5)  # Adam: rounding on near-zero gradients grows
TIGHT = dict(rtol=1e-5, atol=1e-6)


def _load(tmp: Path, rank: int):
    tmp = tmp / f"rank{rank}"
    tmp.mkdir(exist_ok=True)
    serial = load_module(SOURCE, f"nano_serial_{rank}", tmp)
    parallel = load_module(expand(SOURCE), f"nano_parallel_{rank}", tmp)
    return serial, parallel


def _batch():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _train(model, idx, targets):
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _training_parity(rank, world, tmp, tensor):
    from macrogen.runtime.mesh import mesh
    from macrogen.runtime.tensor_parallel import full_state_dict, num_parameters

    os.environ["MACROGEN_TP_SIZE"] = str(tensor)
    S, P = _load(Path(tmp), rank)
    idx, targets = _batch()

    torch.manual_seed(0)
    serial = S.LanguageModel(S.Config(**CONFIG))
    initial = copy.deepcopy(serial.state_dict())
    serial_losses = _train(serial, idx, targets)

    torch.manual_seed(0)
    model = (P.DataParallelLM if world > tensor else P.LanguageModel)(P.Config(**CONFIG))
    m = mesh()
    assert (m.data_size, m.tensor_size) == (world // tensor, tensor)
    # the parent's re-initialization ran on the full layers: exactly the serial draws
    for key, value in full_state_dict(model).items():
        torch.testing.assert_close(value, initial[key], rtol=0, atol=0, msg=f"initial {key}")
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.shape == (3 * CONFIG["n_embd"] // tensor, CONFIG["n_embd"])
    assert model.transformer.wte.weight is model.lm_head.weight  # still tied: one shard
    assert model.lm_head.weight.shape == (CONFIG["vocab_size"] // tensor, CONFIG["n_embd"])
    assert num_parameters(model) == sum(p.numel() for p in serial.parameters())

    share = BATCH // m.data_size
    rows = slice(m.data_rank * share, (m.data_rank + 1) * share)
    losses = _train(model, idx[rows], targets[rows])
    total = torch.stack(losses)
    torch.distributed.all_reduce(total)  # tensor ranks agree; mean over the data ranks
    torch.testing.assert_close(total / world, torch.stack(serial_losses), **SERIAL_TOL)
    final = full_state_dict(model)
    for key, value in serial.state_dict().items():
        got = final[key]
        if key.endswith("c_attn.bias"):
            # the key bias has a zero gradient up to rounding (softmax ignores a constant added
            # to every score); Adam turns that noise into steps of up to lr: bounded, not equal
            q, k, v = got.chunk(3)
            q_s, k_s, v_s = value.chunk(3)
            assert (k - k_s).abs().max() <= ADAM_NOISE, (key, (k - k_s).abs().max())
            got, value = torch.cat([q, v]), torch.cat([q_s, v_s])
        torch.testing.assert_close(
            got, value, **SERIAL_TOL, msg=lambda m, key=key: f"{key} after {STEPS} steps: {m}"
        )
    return final


def _layer_parity(rank, world, tmp):
    """One block, float input: forward and input gradient equal serial and torch's TP."""
    os.environ["MACROGEN_TP_SIZE"] = str(world)
    S, P = _load(Path(tmp), rank)
    config = S.Config(**CONFIG)
    torch.manual_seed(0)
    serial = S.Layer(config)
    torch.manual_seed(0)
    ours = P.Layer(P.Config(**CONFIG))
    x = torch.randn(
        2, CONFIG["block_size"], CONFIG["n_embd"], generator=torch.Generator().manual_seed(2)
    )
    x_s, x_p, x_t = (x.clone().requires_grad_() for _ in range(3))
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    out_s = serial(x_s)
    (out_s * w).sum().backward()
    out_p = ours(x_p)
    (out_p * w).sum().backward()
    torch.testing.assert_close(out_p, out_s, **TIGHT)
    torch.testing.assert_close(x_p.grad, x_s.grad, **TIGHT)

    # torch's tensor parallelism on the same weights, running the same (rewritten) forward
    theirs = _torch_tp(P, serial, world)
    out_t = theirs(x_t)
    (out_t * w).sum().backward()
    torch.testing.assert_close(out_p, out_t, **TIGHT)
    torch.testing.assert_close(x_p.grad, x_t.grad, **TIGHT)
    _steps_match_torch(ours, theirs, x, w, world)

    # HF's post_init() after building the layers: serial draws too
    torch.manual_seed(5)
    hf_serial = S.HFModel(config)
    torch.manual_seed(5)
    hf = P.HFModel(P.Config(**CONFIG))
    from macrogen.runtime.tensor_parallel import full_state_dict

    for key, value in full_state_dict(hf).items():
        torch.testing.assert_close(value, hf_serial.state_dict()[key], rtol=0, atol=0)
    return True


def _steps_match_torch(ours, theirs, x, w, world):
    """3 AdamW steps on both from the same weights: the parameters stay equal (tightly)."""
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.tensor_parallel import full_state_dict

    for model in (ours, theirs):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        for _ in range(STEPS):
            optimizer.zero_grad()
            (model(x) * w).sum().backward()
            optimizer.step()
    mine = full_state_dict(ours)
    for key, value in theirs.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        got = mine[key]
        if "c_attn" in key:  # to torch's row order [q0 k0 v0 q1 k1 v1] (see _torch_tp)
            blocks = [b.chunk(world) for b in got.chunk(3)]
            got = torch.cat([blocks[b][r] for r in range(world) for b in range(3)])
        if key.endswith("c_attn.bias"):  # the key bias: rounding noise, amplified by Adam
            keys = [
                torch.cat([t.chunk(world)[r].chunk(3)[1] for r in range(world)])
                for t in (got, value)
            ]
            assert (keys[0] - keys[1]).abs().max() <= ADAM_NOISE, (key, keys[0] - keys[1])
            got, value = (
                torch.cat(
                    [
                        c
                        for r in range(world)
                        for i, c in enumerate(t.chunk(world)[r].chunk(3))
                        if i != 1
                    ]
                )
                for t in (got, value)
            )
        torch.testing.assert_close(got, value, **TIGHT, msg=lambda m, key=key: f"{key}: {m}")


def _torch_tp(P, serial, world):
    """parallelize_module on the expansion's serial classes: the qkv rows permuted so that a
    contiguous ColwiseParallel shard is our [q_r | k_r | v_r]; head counts set by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layer = copy.deepcopy(serial)
    attn, mlp = layer.attn, layer.mlp
    attn.__class__ = P.SelfAttention  # the expansion's forward: widths rewritten
    mlp.__class__ = P.FeedForward
    with torch.no_grad():  # rows [q0 q1 k0 k1 v0 v1] -> [q0 k0 v0 q1 k1 v1]
        for t in (attn.c_attn.weight, attn.c_attn.bias):
            blocks = [b.chunk(world) for b in t.chunk(3)]
            t.copy_(torch.cat([blocks[b][r] for r in range(world) for b in range(3)]))
    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    layer = parallelize_module(layer, mesh, plan)
    attn.n_head //= world  # torch leaves head counts and widths to the user
    attn.n_embd //= world
    attn.tp_size = world
    return layer


def test_nanogpt_shaped_model_on_two_tensor_ranks(tmp_path):
    run_ranks(_layer_parity, 2, args=(str(tmp_path),), timeout=240)
    finals = run_ranks(_training_parity, 2, args=(str(tmp_path), 2), timeout=240)
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=0, atol=0)


def test_nanogpt_shaped_model_on_data_x_tensor_parallel(tmp_path):
    finals = run_ranks(_training_parity, 4, args=(str(tmp_path), 2), timeout=300)
    for key in finals[0]:  # every rank holds the same model
        torch.testing.assert_close(finals[0][key], finals[3][key], rtol=0, atol=0)


def test_width_arithmetic_is_rewritten_to_the_local_width():
    code = expand(SOURCE)
    assert "k = k.view(B, T, self.n_head, C // self.tp_size // self.n_head).transpose(1, 2)" in code
    assert "y = y.transpose(1, 2).contiguous().view(B, T, C // self.tp_size)" in code
    assert "B, T, C = x.size()  # batch, time, channels" in code  # the binding stays
    assert "b, t = idx.size()" in code  # token ids: no width to rewrite
    # the loss of the vocabulary-sharded head, without gathering the logits
    assert (
        "return vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),"
        " getattr(self.lm_head, 'group', None))"
    ) in code


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "y = y + torch.zeros(B, T, C)",
            "test.py:15:35: error: C is the full width of x",
        ),
    ],
)
def test_width_arithmetic_that_is_ambiguous_is_an_error(line, message):
    source = f"""\
        import torch
        import torch.nn as nn
        import macrogen as mg

        @mg.tensor_parallel(plan={{"fc": "colwise", "proj": "rowwise"}})
        class MLP(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.fc = nn.Linear(d, 4 * d)
                self.proj = nn.Linear(4 * d, d)

            def forward(self, x):
                B, T, C = x.shape
                y = self.fc(x)
                {line}
                return self.proj(y)
        """
    errors = expansion_errors(source)
    assert len(errors) == 1 and errors[0].startswith(message), errors
    assert "write C // self.tp_size" in errors[0]
