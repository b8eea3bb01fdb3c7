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
    for rank in range(2):  # this machine has no GPU: gloo on the CPU
        assert f"rank {rank} of 2 on cpu (backend gloo)" in done.stdout
