"""Uneven data-parallel shares (``dp_shares``) against the serial run on the global batch.

One spawn of 2 gloo ranks runs each case of an expanded file: the parameters after 5 AdamW
steps (float64) equal those of the unexpanded file trained on the whole global batch,
within 1e-10, with fixed uneven shares, a memory cap, an odd batch split "even", zero1, and
"measured" (whatever the clocks said, the update is the serial one), and on a class made
``@data_parallel(dp_shares=...)``. The shares' own
logic (the split, the cap, the rebalance after a rank slows down) is driven by injected
rates in tests/test_hetero.py: no timing here.
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


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.norm = nn.LayerNorm(32)
            self.out = nn.Linear(32, 4)

        def forward(self, x, y):
            logits = self.out(F.gelu(self.norm(self.inp(x))))
            return F.cross_entropy(logits, y)  # a mean over the rows


    @mg.data_parallel(dp_shares=[1, 2])
    class Decorated(Net):
        pass


    def fixed(model):
        return mg.parallelize(model, dp="replicate", dp_shares=[3, 1])


    def capped(model):
        return mg.parallelize(model, dp="replicate", dp_shares=[1, 1], dp_max_rows=[2, 16])


    def even(model):
        return mg.parallelize(model, dp="replicate", dp_shares="even")


    def measured(model):
        return mg.parallelize(model, dp="replicate", dp_shares="measured", dp_rebalance_every=2)


    def zero1(model):
        return mg.parallelize(model, dp="zero1", dp_shares=[1, 3])


    def optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


    def sharded(model):
        return mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


    def train(model, opt, batch, steps):
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(batch, 8, generator=gen)
            y = torch.randint(0, 4, (batch,), generator=gen)
            x, y = mg.shard(model, (x, y))  # serially: the whole batch
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    """
)

# case -> (global batch, the rows rank 0 and rank 1 get at the last step, or None: measured)
CASES = {
    "fixed": (8, [6, 2]),
    "capped": (8, [2, 6]),
    "even": (7, [4, 3]),
    "measured": (8, None),
    "zero1": (8, [2, 6]),
    "Decorated": (9, [3, 6]),  # @data_parallel(dp_shares=[1, 2])
}
STEPS = 5


def _cases(rank: int, world: int, tmp: str) -> dict[str, tuple[float, list[int]]]:
    from macrogen.runtime.data_parallel import gradient_sync

    torch.set_default_dtype(torch.float64)
    serial = load_module(SOURCE, f"hetero_serial_{rank}", Path(tmp))
    parallel = load_module(expand(SOURCE), f"hetero_expanded_{rank}", Path(tmp))
    results = {}
    for case, (batch, _) in CASES.items():
        decorated = case == "Decorated"
        torch.manual_seed(0)
        reference = serial.Decorated() if decorated else serial.Net()
        serial.train(reference, serial.optimizer(reference), batch, STEPS)
        torch.manual_seed(0)
        model = parallel.Decorated() if decorated else getattr(parallel, case)(parallel.Net())
        opt = parallel.sharded(model) if case == "zero1" else parallel.optimizer(model)
        parallel.train(model, opt, batch, STEPS)
        if case == "zero1":
            opt.finish_gather()  # (the all-gather of the last step's shares)
        error = max(
            float((a - b).abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        shares = gradient_sync(model).shares
        assert shares is not None
        results[case] = (error, shares.rows)
    return results


def test_uneven_shares_step_as_serial_on_the_global_batch(tmp_path):
    ranks = run_ranks(_cases, 2, args=(str(tmp_path),), timeout=120)
    for case, (batch, rows) in CASES.items():
        (error0, rows0), (error1, rows1) = ranks[0][case], ranks[1][case]
        assert max(error0, error1) < 1e-10, (case, error0, error1)
        assert rows0 == rows1 and sum(rows0) == batch, (case, rows0, rows1)  # agreed, every row
        if rows is not None:
            assert rows0 == rows, (case, rows0)
