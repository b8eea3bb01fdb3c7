"""Kill a rank under ``torchrun --max-restarts 3``; the job finishes with bit-identical parameters.

Each kill test launches torchrun on ``tests/checkpoint_train.py`` (a tiny model, 24 steps,
a checkpoint every 4), with a time bound per launch; the uninterrupted references run
the same script on forked ranks (``run_script``: torchrun's attempt without its start-up).
A checkpoint from 4 ranks then resumes on 2 ranks and on 1 process (DCP reshards), equal
within fp32 rounding.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_script

SCRIPT = Path(__file__).with_name("checkpoint_train.py")
TIMEOUT = 400  # seconds per launch: a loaded 2-core machine starts 4 ranks slowly
EVERY = 4

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]  # spawns ranks (torchrun restarts)


def launch(
    tmp: Path, name: str, nproc: int, *extra: str, ckpt: Path | None = None, torchrun: bool = True
) -> dict:
    """Run the script (under torchrun when nproc > 0; on forked ranks when not ``torchrun``);
    rank 0's final parameters."""
    out = tmp / f"{name}.pt"
    args = ["--dir", str(ckpt or tmp / name), "--out", str(out), "--every", str(EVERY), *extra]
    if nproc and not torchrun:
        env = {"CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
        run_script(str(SCRIPT), args, nproc, env=env, timeout=TIMEOUT)
        return torch.load(out)
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "--max-restarts=3", "--monitor-interval=0.1",
               str(SCRIPT), *args]  # fmt: skip
    else:
        cmd = [sys.executable, str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPT_TEST_TIMEOUT": str(TIMEOUT - 20)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out)


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic")


# The uninterrupted runs on forked ranks: what torchrun's one attempt runs, without its start-up.
@pytest.fixture(scope="module")
def reference2(tmp: Path) -> dict:
    return launch(tmp, "ref2", 2, torchrun=False)


@pytest.fixture(scope="module")
def reference4(tmp: Path) -> dict:
    return launch(tmp, "ref4", 4, torchrun=False)


# Kill points from a fixed seed list, plus one the step after a save started: the
# killed rank dies while DCP's background thread is still writing that checkpoint.
TRIALS = [
    (f"seed{seed}", random.Random(seed).randrange(2), random.Random(seed).randrange(1, 23))
    for seed in (0,)
] + [("during-save", 1, 2 * EVERY)]


@pytest.mark.parametrize("name,rank,step", TRIALS, ids=[t[0] for t in TRIALS])
def test_kill_one_of_2_ranks(tmp: Path, reference2: dict, name: str, rank: int, step: int) -> None:
    assert identical(launch(tmp, f"kill2-{name}", 2, "--kill", f"{rank}:{step}"), reference2)


def test_kill_one_of_4_ranks(tmp: Path, reference4: dict) -> None:
    assert identical(launch(tmp, "kill4", 4, "--kill", f"3:{3 * EVERY + 1}"), reference4)


@pytest.mark.parametrize("nproc", [2, 0], ids=["2-ranks", "1-process"])
def test_checkpoint_from_4_ranks_resumes_at_fewer(
    tmp: Path, reference2: dict, reference4: dict, nproc: int
) -> None:
    ckpt = tmp / f"from4-to{nproc}"
    shutil.copytree(tmp / "ref4", ckpt)
    shutil.rmtree(ckpt / "step_00000024")  # resume from step 20, saved by 4 ranks
    resumed = launch(tmp, f"from4-to{nproc}", nproc, ckpt=ckpt, torchrun=False)
    for key, value in reference2.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6)
