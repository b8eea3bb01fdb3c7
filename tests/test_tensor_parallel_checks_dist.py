"""@tensor_parallel's start-up checks on 2 ranks: a plan left whole warns; ranks that divide
different serial values (n_head 8 and 4) are an error naming the serial values."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

SOURCE = """
import torch.nn as nn
import macrogen as mg

@mg.tensor_parallel(plan={"qkv": ("colwise", 3), "n_head": "divide"})
class Attn(nn.Module):
    def __init__(self, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(16, 48)
"""


def _checks(rank, world, tmp):
    from macrogen.runtime import mesh as meshes

    module = load_module(expand(SOURCE), f"tp_checks_{rank}", Path(tmp))
    os.environ.pop(meshes.SIZE_ENV, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.Attn(8)  # no size=, MACROGEN_TP_SIZE unset: whole layers on every rank
    whole = [
        w
        for w in caught
        if "plan Attn: the tensor-parallel size is 1 in a job of 2" in str(w.message)
    ]
    assert whole, [str(w.message) for w in caught]
    assert whole[0].filename == __file__, whole[
        0
    ].filename  # the line that built it, not contextlib
    meshes.reset()
    os.environ[meshes.SIZE_ENV] = "2"
    with pytest.raises(RuntimeError, match=r"n_head: 'divide' = 8 on rank 0 but n_head: 'divide' = 4"):  # fmt: skip
        module.Attn(8 if rank == 0 else 4)
    return True


def test_whole_plan_warns_and_divided_serial_values_must_agree(tmp_path):
    assert run_ranks(_checks, 2, args=(str(tmp_path),), timeout=120) == [True, True]
