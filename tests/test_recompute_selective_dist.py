"""``mg.parallelize(dp="fsdp", recompute=2)`` on two gloo ranks against the serial model.

A GPT-style model of 4 blocks, float64, 3 AdamW steps: blocks 0 and 2 are
recomputed (FSDP gathers their units again for it), 1 and 3 keep their
activations; losses and the final parameters match the serial program within
1e-10.
"""

from __future__ import annotations

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
    import macrogen as mg

    VOCAB = 64


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.norm(x))))


    class GPT(nn.Module):
        def __init__(self, dim=32, layers=4):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, dim)
            self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
            self.out = nn.Linear(dim, VOCAB, bias=False)

        def forward(self, ids):
            x = self.tok(ids)
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(self.out(x).view(-1, VOCAB), ids.view(-1))


    def parallel(model):
        return mg.parallelize(model, dp="fsdp", recompute=2)
    """
)
STEPS, BATCH, SEQ = 3, 4, 8


def _train(model, rows):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=gen)[rows]
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _parity(rank, world, tmp):
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    serial_module = load_module(SOURCE, f"serial_every_{rank}", Path(tmp))
    module = load_module(expand(SOURCE), f"expanded_every_{rank}", Path(tmp))
    torch.manual_seed(0)
    serial = serial_module.GPT()
    torch.manual_seed(0)
    model = module.parallel(module.GPT())
    chosen = [i for i, b in enumerate(model.layers) if getattr(b.forward, "_mg_recomputed", False)]
    share = BATCH // world
    losses = _train(model, slice(rank * share, (rank + 1) * share))
    dist.all_reduce(losses)  # each rank's mean over its rows: the serial mean is their mean
    torch.testing.assert_close(losses / world, _train(serial, slice(None)), rtol=0, atol=1e-10)
    for key, value in serial.state_dict().items():
        got = model.state_dict()[key]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        torch.testing.assert_close(got, value, rtol=0, atol=1e-10, msg=key)
    return chosen


def test_every_2nd_block_recomputed_under_fsdp_matches_serial(tmp_path):
    assert run_ranks(_parity, 2, args=(str(tmp_path),), timeout=180) == [[0, 2], [0, 2]]
