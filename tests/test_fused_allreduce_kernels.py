"""The generated pack/unpack kernels under TRITON_INTERPRET=1, in a process of their own.

The interpreter is chosen when triton is imported, so the check runs in a fresh
interpreter process with the variable set (see ``tests/fused_kernels_check.py``).
"""

from pathlib import Path

from tests.helpers import run_interpreted


def test_generated_kernels_match_torch_under_the_interpreter(tmp_path: Path):
    done = run_interpreted("tests.fused_kernels_check", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: 8 cases, 16 buffers"), done.stdout
