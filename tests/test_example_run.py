"""README's main command: examples/run.py trains serially and on 2 ranks, and they agree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_examples_run_agrees_and_names_each_ranks_device_and_backend():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run.py"), "--steps", "2"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serial and data-parallel training agree" in done.stdout
    assert "Warning" not in done.stderr, done.stderr  # (tp 1 is the demo's choice: nothing to warn)
    for rank in range(2):  # what the decision function picks for this host: cpu/gloo, or GPUs
        where = placement_here(rank, 2)
        assert f"rank {rank} of 2 on {where.device} (backend {where.backend})" in done.stdout


def placement_here(local_rank: int, local_world_size: int):
    import torch

    from macrogen.runtime.groups import BACKEND_ENV, choose_placement

    cuda = torch.cuda.is_available()
    return choose_placement(
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        local_rank=local_rank,
        local_world_size=local_world_size,
        requested=os.environ.get(BACKEND_ENV),
    )
