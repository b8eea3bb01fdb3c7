"""bench/probes.py's battery (issue 43's hostile inputs), a fast sample of it: cases that start
no ranks (the commands' values and files, the environment's variables), each in a process of
its own forked from one that imported torch once. The whole battery is a bench run:
``python -m bench.probes``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.probes import verdicts
from bench.probes.runner import Result

REPO = Path(__file__).resolve().parent.parent


def test_a_sample_of_the_fast_probes_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "bench.probes", "--fast", "--sample", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "traceback 0, hang 0, silent wrong 0, failed 0; 16 cases" in done.stdout, done.stdout


def _result(err: str, code: int | None = 1) -> Result:
    return Result(codes=[code], outs=[""], errs=[err], seconds=1.0)


def test_a_raw_error_is_a_traceback_and_a_named_refusal_is_not():
    raw = (
        'Traceback (most recent call last):\n  File "/x/torch/distributed/rendezvous.py", line 3\n'
        "TypeError: __init__(): incompatible constructor arguments.\n    1. (a: int)\n"
    )
    assert verdicts.program_refusal(_result(raw)).outcome == "traceback"
    named = (
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "/x/macrogen/runtime/'
        'groups.py", line 9, in f\n[rank0]: macrogen.runtime.groups.StartupError: MASTER_PORT='
        "'abc': expected a whole number from 1 to 65535\n"
    )
    verdict = verdicts.program_refusal(_result(named))
    assert verdict == verdicts.Verdict("ok", "StartupError: MASTER_PORT='abc': expected a whole"
                                       " number from 1 to 65535")  # fmt: skip
    assert verdicts.program_refusal(_result("", 0)).outcome == "silent wrong"
    assert verdicts.program_refusal(_result("", None)).outcome == "hang"
