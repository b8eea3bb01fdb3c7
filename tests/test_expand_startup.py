"""Start-up of ``macrogen expand`` stays light: no torch, triton, rich, libcst or jinja2
before a file needs them (issue 15: start-up <= 0.15 s; a heavy import at the top of a
command or macro module would undo it silently, so the modules are checked, not timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "triton", "rich", "libcst", "jinja2", "numpy")


def imported_after(code: str) -> set[str]:
    """The HEAVY modules a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_expand_help_imports_nothing_heavy():
    code = (
        "from macrogen.cli import main\n"
        "try:\n    main(['expand', '--help'])\nexcept SystemExit:\n    pass\n"
    )
    assert imported_after(code) == set()


def test_importing_the_cli_imports_nothing_heavy():
    # (``macrogen --help`` lists every command, so it imports each command module;
    # commands/checkpoint.py imports macrogen.runtime.checkpoint, hence torch.)
    assert imported_after("import macrogen.cli\nimport macrogen.commands.expand") == set()


def test_expanding_files_without_macros_imports_nothing_heavy(tmp_path: Path):
    (tmp_path / "a.py").write_text("import torch\n\nx = torch.zeros(3)  # no macros here\n")
    (tmp_path / "b.py").write_text("print('hello')\n")
    code = f"from macrogen.cli import main\nassert main(['expand', {str(tmp_path)!r}, '--check', '--in-place']) == 0\n"
    assert imported_after(code) == set()


def test_expanding_a_file_with_macros_imports_no_torch_triton_or_rich(tmp_path: Path):
    golden = Path(__file__).parent / "golden"
    names = ["tile_softmax", "tensor_parallel_attention_mlp", "data_parallel_all_arguments"]
    names += ["fused_allreduce_k3", "target_runtime", "tunable_constant", "define_constant"]
    sources = [str(golden / name / "input.py") for name in names]
    code = (
        "import io\nfrom macrogen.commands.expand import expand_files\n"
        f"assert expand_files({sources!r}, stdout=io.BytesIO()) == 0\n"
    )
    assert imported_after(code) == {"libcst", "jinja2"}


def test_the_tuning_file_name_is_the_databases():
    from macrogen.autotune import database
    from macrogen.commands import expand

    assert expand.TUNING_FILE == database.DEFAULT_NAME
