"""@tensor_parallel on Hugging Face's ``Conv1D`` (GPT-2's layers: an nn.Linear stored ``(in, out)``).

A GPT-2-shaped attention (a fused, packed ``c_attn``) and MLP written with
transformers' own ``Conv1D``, on 2 gloo ranks in float64: the shards keep
Conv1D's ``(in, out)`` layout (so ``full_state_dict()`` is the serial state
dict, keys and shapes), and the losses, gradients and parameters after 3 AdamW
steps equal serial within 1e-10.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from transformers.pytorch_utils import Conv1D

    import macrogen as mg


    @mg.tensor_parallel(plan={"c_attn": ("colwise", 3), "c_proj": "rowwise", "n_head": "divide"})
    class Attention(nn.Module):
        def __init__(self, dim, n_head):
            super().__init__()
            self.n_head = n_head
            self.c_attn = Conv1D(3 * dim, dim)
            self.c_proj = Conv1D(dim, dim)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


    @mg.tensor_parallel(plan={"c_fc": "colwise", "c_proj": "rowwise"})
    class MLP(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.c_fc = Conv1D(4 * dim, dim)
            self.c_proj = Conv1D(dim, 4 * dim)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))


    class Block(nn.Module):
        def __init__(self, dim=16, n_head=4):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.attn = Attention(dim, n_head)
            self.mlp = MLP(dim)

        def forward(self, x):
            x = x + self.attn(self.ln(x))
            return (x + self.mlp(x)).square().mean()
    """
)

STEPS, TOL = 3, dict(rtol=1e-10, atol=1e-10)


def _parity(rank, world, tmp):
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.tensor_parallel import full_gradients, full_state_dict

    os.environ["MACROGEN_TP_SIZE"] = str(world)
    torch.set_default_dtype(torch.float64)
    tmp = Path(tmp) / f"rank{rank}"
    tmp.mkdir(exist_ok=True)
    S = load_module(SOURCE, f"conv1d_serial_{rank}", tmp)
    P = load_module(expand(SOURCE), f"conv1d_parallel_{rank}", tmp)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for module in (S, P):
        torch.manual_seed(0)
        model = module.Block()
        initial = full_state_dict(model)  # (a copy: serially, the state dict itself)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], None
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = model(x)
            loss.backward()
            if step == 0:
                grads = full_gradients(model)
            optimizer.step()
            losses.append(loss.detach())
        results.append((model, initial, torch.stack(losses), grads, full_state_dict(model)))
    (serial, s_init, s_losses, s_grads, s_final), (ours, init, losses, grads, final) = results
    attn = ours.attn
    assert isinstance(attn.c_attn.weight, DTensor) and attn.c_attn.weight.shape == (16, 48)
    assert attn.c_attn.weight.to_local().shape == (16, 48 // world)  # Conv1D's (in, out / T)
    assert attn.c_proj.weight.to_local().shape == (16 // world, 16)  # (in / T, out)
    assert ours.mlp.c_fc.weight.to_local().shape == (16, 64 // world)
    for key, value in s_init.items():  # the serial state dict: keys, (in, out) shapes, values
        torch.testing.assert_close(init[key], value, rtol=0, atol=0, msg=f"initial {key}")
    torch.testing.assert_close(losses, s_losses, **TOL)
    for key, grad in s_grads.items():
        torch.testing.assert_close(grads[key], grad, **TOL, msg=f"gradient {key}")
    for key, value in s_final.items():
        torch.testing.assert_close(final[key], value, **TOL, msg=f"{key} after {STEPS} steps")
    return True


def test_hf_conv1d_layers_shard_and_match_serial_on_two_ranks(tmp_path):
    assert run_ranks(_parity, 2, args=(str(tmp_path),), timeout=180) == [True, True]
