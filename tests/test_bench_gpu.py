"""bench/gpu.py --dry-run: the GPU machine's one command, run here on CPU (issue 28).

The dry run takes every code path the GPU run takes (tile kernels under
TRITON_INTERPRET=1, the runtime kernels, fused_allreduce at world size 1 on
gloo, one training step per parallel wrapper against its torch peer) at tiny
sizes and checks each result; its times mean nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

from bench.tile import PATTERNS
from tests.helpers import REPO


def test_dry_run_checks_every_row_and_exits_zero() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        # (the attention section: through the session script, below)
        [sys.executable, "bench/gpu.py", "--dry-run", "--only", "tile", "kernels"]
        + ["fused_allreduce", "training"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for p in PATTERNS:
        if p.name.startswith("attention"):  # (the attention section's)
            continue
        assert any(line.startswith("tile") and p.name.split()[0] in line for line in lines), p.name
    cases = ("compress", "decompress", "fused pack", "fused unpack")
    training = ("@data_parallel", "shard_optimizer", "parallelize tp=1", "parallelize fsdp")
    for case in (*cases, "16 small fp32", *training, "@data_parallel compiled"):
        assert any(case in line for line in lines), case
    assert lines[-1].endswith(" 0 wrong ==")
    assert not any(" NO " in line or "CRASH" in line for line in lines)


def test_a_wrong_or_crashed_row_fails_the_run() -> None:
    sys.path.insert(0, str(REPO))
    from bench.gpu import Row

    assert Row("tile", "x", float("nan"), 1e-4, 0.0, "", 0.0, "").wrong  # a crash reads as NaN
    assert Row("tile", "x", 2e-4, 1e-4, 0.0, "", 0.0, "").wrong
    assert not Row("tile", "x", 0.0, 0.0, 0.0, "", 0.0, "").wrong


def _run(code_or_args: list[str], extra_env: dict[str, str] | None = None):
    env = dict(os.environ, PYTHONPATH=str(REPO), **(extra_env or {}))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        code_or_args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_training_rows_run_with_cudas_foreach_optimizer_step() -> None:
    """On CUDA, AdamW defaults to its foreach step, which refuses torch TP's mix of DTensor
    and plain parameters (the H200 run's crash): the training rows run under that default."""
    code = (
        "import sys, torch.optim.adam as adam\n"
        "adam._default_to_fused_or_foreach = lambda *a, **k: (False, True)  # CUDA's choice\n"
        "sys.argv = ['bench/gpu.py', '--dry-run', '--only', 'training']\n"
        "import runpy; runpy.run_path('bench/gpu.py', run_name='__main__')\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parallelize tp=1" in proc.stdout and "CRASH" not in proc.stdout


def test_the_gpu_sessions_script_runs_its_steps_and_logs_each(tmp_path) -> None:
    proc = _run(
        ["bash", "bench/gpu_session.sh", str(tmp_path)],
        {"DRY": "1", "ONLY": "kernels", "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = (tmp_path / "status.txt").read_text()
    assert "kernels: exit 0" in status and "training" not in status  # ONLY: the step asked for
    assert " 0 wrong ==" in (tmp_path / "kernels.txt").read_text()
    assert not (REPO / "macrogen" / "kernels").is_symlink()  # macrogen.kernels resolved as is


def test_the_gpu_sessions_attention_step_runs_the_sdpa_comparison(tmp_path) -> None:
    """The step the next GPU session pastes from: every row it prints, dry here."""
    proc = _run(
        ["bash", "bench/gpu_session.sh", str(tmp_path)],
        {"DRY": "1", "ONLY": "attention", "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention: exit 0" in (tmp_path / "status.txt").read_text()
    lines = (tmp_path / "attention.txt").read_text().splitlines()
    cases = ("float16 d64 full fwd ", "float16 d64 full fwd+bwd", "bfloat16 d128 causal fwd+bwd")
    for case in cases:
        assert any(line.startswith("attention") and case in line for line in lines), case
    assert lines[-1].endswith(" 4 rows, 0 wrong ==")
