"""The generated pack/unpack kernels under TRITON_INTERPRET=1, in a process of their own.

The interpreter is chosen when triton is imported, so the check runs in a fresh
interpreter process with the variable set (see ``tests/fused_kernels_check.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_kernels_match_torch_under_the_interpreter(tmp_path: Path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.fused_kernels_check", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: 8 cases, 16 buffers"), done.stdout
