"""The small programs the probes run, each a whole annotated source (the unexpanded file is
the serial program). A program that trains prints ``RESULT <json>`` on rank 0: its losses
and parameters, which the probe compares with the serial run's."""

from __future__ import annotations

# Reads every variable the runtime reads in one run: the launch (RANK, WORLD_SIZE,
# LOCAL_*, MASTER_*, MACROGEN_BACKEND, MACROGEN_TIMEOUT), a @tensor_parallel class's size
# (MACROGEN_TP_SIZE), a resumable loop (MACROGEN_FRESH), through the import hook
# (MACROGEN_DISABLE, MACROGEN_SHOW_EXPANDED, MACROGEN_CACHE_DIR, MACROGEN_TUNING).
ENV_PROGRAM = """\
import torch
import torch.nn as nn
import macrogen as mg

WIDTH = mg.define(4)


@mg.tensor_parallel(plan={"up": "colwise", "down": "rowwise"})
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 8)
        self.down = nn.Linear(8, WIDTH)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


run = mg.launch()
torch.manual_seed(0)
model = Mlp()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in mg.resumable(range(2), model=model, optimizer=opt, dir="ckpt", every=1):
    loss = model(torch.ones(2, WIDTH)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("LAUNCHED", run.rank, run.world_size, loss.item())
"""

# A model with every part a plan can name: an embedding (servers), blocks (tp, pp).
NET = """\
import json
import torch
import torch.nn as nn
import macrogen as mg


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = self.emb(x).mean(1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).squeeze(-1)
"""

# Applied twice: the second call is an error naming the first (issue 43, item 2).
TWICE = (
    NET
    + """

torch.manual_seed(0)
model = Net().double()
model = mg.parallelize(model, {call})
model = mg.parallelize(model, {call})
print("applied twice, no error")
"""
)

# Trains 3 steps on the whole batch split over the data ranks; rank 0 prints the result.
TRAIN = (
    NET
    + """

def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 16, (8, 4), generator=g), torch.randn(8, generator=g, dtype=torch.float64)


run = mg.launch()
torch.manual_seed(0)
model = Net().double()
model = mg.parallelize(model, {call})
opt = torch.optim.{optimizer}(model.parameters(), lr=0.1)
{shard}losses = []
for step in range(3):
    ids, y = batch(step)
    m = mg.mesh()
    rows = slice(m.data_rank * 8 // m.data_size, (m.data_rank + 1) * 8 // m.data_size)
    loss = ((model(ids[rows]) - y[rows]) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(float(loss))
params = {{}}
for name, p in model.named_parameters():
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    params[name] = full.detach().reshape(-1).tolist()
if run.rank == 0:
    print("RESULT", json.dumps({{"params": params}}))
"""
)

# dp="none" on two data ranks: the replicas diverge; the program must say so (item 5).
NONE_DP = (
    NET
    + """

run = mg.launch()
torch.manual_seed(run.rank)  # replicas that differ: nothing keeps them equal
model = mg.parallelize(Net(), dp="none")
print("trained", run.rank)
"""
)


def tile(body: str, loop: str, size: int = 6) -> str:
    """A @tile function whose loop is ``loop`` and body ``body``, run on ``size`` elements;
    prints its output (NaN where it wrote nothing)."""
    return f"""\
import json
import torch
import macrogen as mg


@mg.tile(i=4)
def f(out, x):
    (M,) = x.shape
    {loop}
        {body}


x = torch.arange(1.0, {size} + 1.0)
out = torch.full(({size},), float("nan"))
f(out, x)
print("RESULT", json.dumps({{"out": out.tolist()}}))
"""
