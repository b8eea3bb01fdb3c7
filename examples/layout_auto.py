"""A model of 8 blocks whose parallel layout `macrogen autotune --world-size N` chooses (docs/autotune.md)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import macrogen as mg

DIM, HIDDEN, BLOCKS, BATCH, SEQ = 64, 256, 8, 16, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = 6  # tp must divide it: tp=4 is infeasible
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build():
    run = mg.launch()  # this rank's device: its GPU under torchrun on a CUDA host, else the CPU
    model = mg.parallelize(
        Net().to(run.device),
        layout="auto",
        tp_plan={"layers.*.fc": "colwise", "layers.*.proj": "rowwise", "layers.*.n_head": "divide"},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after the cut: this stage's
    mesh = mg.mesh(model)  # the mesh it was parallelized on
    share = BATCH // mesh.data_size  # the global batch is fixed: each data rank trains its share
    data = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(BATCH, SEQ, DIM, generator=data).to(run.device),
        torch.randn(BATCH, SEQ, DIM, generator=data).to(run.device),
    )
    rows = slice(mesh.data_rank * share, (mesh.data_rank + 1) * share)

    def step():
        opt.zero_grad()
        # forward, loss and backward; through the micro-batches' schedule when pp > 1
        mg.pipeline_step(model, x[rows], y[rows], F.mse_loss)
        opt.step()

    return model, step, {"tokens": BATCH * SEQ}
