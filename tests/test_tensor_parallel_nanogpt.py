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

# nanoGPT's model.py as Karpathy wrote it (shrunk: no flash check, no from_pretrained, no
# generate), annotated the natural way: @tensor_parallel on the attention and the MLP only.
# GPT.__init__ builds the Blocks that build them, ties wte to lm_head, re-draws every
# weight (self.apply(self._init_weights)) and the residual projections by name.
NANOGPT = textwrap.dedent(
    '''
    import inspect
    import math
    from dataclasses import dataclass

    import torch
    import torch.nn as nn
    from torch.nn import functional as F

    import macrogen as mg


    class LayerNorm(nn.Module):
        """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, input):
            return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


    @mg.tensor_parallel(
        plan={"c_attn": ("colwise", 3), "c_proj": "rowwise", "n_head": "divide", "n_embd": "divide"}
    )
    class CausalSelfAttention(nn.Module):

        def __init__(self, config):
            super().__init__()
            assert config.n_embd % config.n_head == 0
            # key, query, value projections for all heads, but in a batch
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            # output projection
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            # regularization
            self.attn_dropout = nn.Dropout(config.dropout)
            self.resid_dropout = nn.Dropout(config.dropout)
            self.n_head = config.n_head
            self.n_embd = config.n_embd
            self.dropout = config.dropout

        def forward(self, x):
            B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

            # calculate query, key, values for all heads in batch and move head forward to be the batch dim
            q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)

            # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

            # output projection
            y = self.resid_dropout(self.c_proj(y))
            return y


    @mg.tensor_parallel(plan={"c_fc": "colwise", "c_proj": "rowwise"})
    class MLP(nn.Module):

        def __init__(self, config):
            super().__init__()
            self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.gelu    = nn.GELU()
            self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, x):
            x = self.c_fc(x)
            x = self.gelu(x)
            x = self.c_proj(x)
            x = self.dropout(x)
            return x


    class Block(nn.Module):

        def __init__(self, config):
            super().__init__()
            self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
            return x


    @dataclass
    class GPTConfig:
        block_size: int = 16
        vocab_size: int = 64
        n_layer: int = 2
        n_head: int = 4
        n_embd: int = 32
        dropout: float = 0.0
        bias: bool = True


    class GPT(nn.Module):

        def __init__(self, config):
            super().__init__()
            assert config.vocab_size is not None
            assert config.block_size is not None
            self.config = config

            self.transformer = nn.ModuleDict(dict(
                wte = nn.Embedding(config.vocab_size, config.n_embd),
                wpe = nn.Embedding(config.block_size, config.n_embd),
                drop = nn.Dropout(config.dropout),
                h = nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f = LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            # with weight tying when using torch.compile() some warnings get generated:
            # "UserWarning: functional_call was passed multiple values for tied weights.
            # This behavior is deprecated and will be an error in future versions"
            # not 100% sure what this is, so far seems to be harmless. TODO investigate
            self.transformer.wte.weight = self.lm_head.weight # https://paperswithcode.com/method/weight-tying

            # init all weights
            self.apply(self._init_weights)
            # apply special scaled init to the residual projections, per GPT-2 paper
            for pn, p in self.named_parameters():
                if pn.endswith('c_proj.weight'):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

        def get_num_params(self, non_embedding=True):
            n_params = sum(p.numel() for p in self.parameters())
            if non_embedding:
                n_params -= self.transformer.wpe.weight.numel()
            return n_params

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets=None):
            device = idx.device
            b, t = idx.size()
            assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
            pos = torch.arange(0, t, dtype=torch.long, device=device) # shape (t)

            # forward the GPT model itself
            tok_emb = self.transformer.wte(idx) # token embeddings of shape (b, t, n_embd)
            pos_emb = self.transformer.wpe(pos) # position embeddings of shape (t, n_embd)
            x = self.transformer.drop(tok_emb + pos_emb)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)

            if targets is not None:
                # if we are given some desired targets also calculate the loss
                logits = self.lm_head(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            else:
                # inference-time mini-optimization: only forward the lm_head on the very last position
                logits = self.lm_head(x[:, [-1], :]) # note: using list [-1] to preserve the time dim
                loss = None

            return logits, loss

        def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
            param_dict = {pn: p for pn, p in self.named_parameters()}
            param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
            decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
            nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
            optim_groups = [
                {'params': decay_params, 'weight_decay': weight_decay},
                {'params': nodecay_params, 'weight_decay': 0.0}
            ]
            fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
            use_fused = fused_available and device_type == 'cuda'
            extra_args = dict(fused=True) if use_fused else dict()
            optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
            return optimizer
    '''
)
NANOGPT_TOL = dict(rtol=1e-10, atol=1e-10)  # float64

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


def _batch(vocab=CONFIG["vocab_size"], block=CONFIG["block_size"]):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (BATCH, block + 1), generator=g)
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
    from macrogen.runtime.tensor_parallel import full_state_dict

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
    local = block.attn.c_attn.weight.to_local()
    assert local.shape == (3 * CONFIG["n_embd"] // tensor, CONFIG["n_embd"])
    assert model.transformer.wte.weight is model.lm_head.weight  # still tied: one shard
    assert model.lm_head.weight.to_local().shape == (
        CONFIG["vocab_size"] // tensor,
        CONFIG["n_embd"],
    )
    # DTensor parameters: whole-model tools count the serial model
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in serial.parameters())

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


def _natural_nanogpt(rank, world, tmp):
    """nanoGPT as written, @tensor_parallel on attention and MLP only, in float64: GPT (which
    builds and re-initializes them) is where the plans apply, so it starts from the serial
    weights, trains equal to serial and counts the serial parameters."""
    from macrogen.runtime.tensor_parallel import full_state_dict

    torch.set_default_dtype(torch.float64)
    try:
        tmp = Path(tmp) / f"natural{rank}"
        tmp.mkdir(exist_ok=True)
        S = load_module(NANOGPT, f"nanogpt_serial_{rank}", tmp)
        P = load_module(expand(NANOGPT), f"nanogpt_parallel_{rank}", tmp)
        idx, targets = _batch(vocab=64, block=16)
        runs = []
        for module in (S, P):
            torch.manual_seed(0)
            model = module.GPT(module.GPTConfig())
            initial = full_state_dict(model)
            optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
            losses = []
            for _ in range(STEPS):
                optimizer.zero_grad()
                _, loss = model(idx, targets)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
            model.eval()
            with torch.no_grad():
                logits, _ = model(idx)  # generate()'s call: the last position's logits
            counts = (model.get_num_params(), model.get_num_params(non_embedding=False))
            runs.append((model, initial, torch.stack(losses), logits, counts))
    finally:
        torch.set_default_dtype(torch.float32)
    (serial, s_init, s_losses, s_logits, s_counts), (ours, init, losses, logits, counts) = runs
    attn = ours.transformer.h[0].attn
    assert attn.c_attn.weight.to_local().shape == (3 * 32 // world, 32), "not sharded"
    assert counts == s_counts, (counts, s_counts)
    for key, value in s_init.items():  # GPT's re-initialization ran on the serial layers
        torch.testing.assert_close(init[key], value, rtol=0, atol=0, msg=f"initial {key}")
    torch.testing.assert_close(losses, s_losses, **NANOGPT_TOL)
    torch.testing.assert_close(logits, s_logits, **NANOGPT_TOL)
    final = full_state_dict(ours)
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(
            final[key], value, **NANOGPT_TOL, msg=lambda m, key=key: f"{key} after training: {m}"
        )
    return True


def _two_tensor_ranks(rank, world, tmp):
    """Every 2-rank check in one spawn."""
    _layer_parity(rank, world, tmp)
    _natural_nanogpt(rank, world, tmp)
    return _training_parity(rank, world, tmp, 2)


def test_nanogpt_shaped_model_on_two_tensor_ranks(tmp_path):
    finals = run_ranks(_two_tensor_ranks, 2, args=(str(tmp_path),), timeout=300)
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=0, atol=0)


def test_nanogpt_as_written_gets_the_plan_less_decorator_on_gpt():
    """GPT builds the decorated classes and re-initializes them: the expansion makes it the
    construction that applies their plans (only the class line changes)."""
    code = expand(NANOGPT)
    assert (
        "# macrogen: GPT builds tensor-parallel classes and re-initializes them: their plans"
        " apply where its construction ends\n@tensor_parallel_class('GPT', None, {})\nclass"
        " GPT(nn.Module):"
    ) in code
    assert "tensor_parallel_class('Block'" not in code  # it re-initializes nothing


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
        " self.tp_group)"
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
