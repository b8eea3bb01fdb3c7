"""``resumable`` over a model with server tables, under ``torchrun --max-restarts=1``.

2 workers + 1 server (tests/param_server_kill_train.py): worker 1 SIGKILLs itself at
step 5 (the last complete checkpoint is step 4's, or step 2's while step 4's
asynchronous save is still being written); torchrun restarts every rank, the server
with a fresh RPC agent, and the job resumes from the checkpoint, which holds the
server's rows, Adagrad sums and step counts. The final dense parameters, table and
Adagrad state are bit-identical to the uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from macrogen.runtime.checkpoint_convert import convert
from tests.distributed import run_script

SCRIPT = Path(__file__).with_name("param_server_kill_train.py")
TIMEOUT = 240  # seconds per launch


def _launch(tmp: Path, name: str, *extra: str) -> dict:
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "--max-restarts=1", "--monitor-interval=0.1", str(SCRIPT),
           "--dir", str(tmp / name), "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


@pytest.mark.timeout(600)
def test_killed_worker_resumes_server_tables_bit_identical(tmp_path: Path) -> None:
    # the uninterrupted run on forked ranks: what torchrun's one attempt runs, without its start-up
    whole_args = ["--dir", str(tmp_path / "whole"), "--out", str(tmp_path / "whole.pt")]
    env = {"CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
    run_script(str(SCRIPT), whole_args, 3, env=env, timeout=TIMEOUT)
    whole = torch.load(tmp_path / "whole.pt")
    killed = _launch(tmp_path, "killed", "--kill", "1:5")  # saves at steps 2 and 4, killed at 5
    assert int(whole.pop("_restarts")) == 0 and int(killed.pop("_restarts")) == 1
    # the restarted attempt resumed from a checkpoint (a rerun from step 0 would also match):
    # step 4's, or step 2's when step 4's asynchronous save was still being written at the kill
    assert int(whole.pop("_first")) == 0 and int(killed.pop("_first")) in (2, 4)
    assert {"emb.weight", "emb.adagrad_sum", "emb.step", "head.weight"} <= whole.keys()
    assert whole.keys() == killed.keys()
    assert int(whole["emb.step"]) == 8 and whole["emb.adagrad_sum"].count_nonzero() > 0
    for key, value in whole.items():
        assert torch.equal(killed[key], value), f"{key} differs after kill and resume"
    # the last checkpoint (step 8) holds the server's rows, Adagrad sums and step counts
    saved = tmp_path / "saved.pt"
    convert(tmp_path / "killed", saved, model_only=False)
    servers = torch.load(saved)["servers"]
    for key in ("emb.weight", "emb.adagrad_sum", "emb.step"):
        assert torch.equal(servers[key], whole[key]), key
