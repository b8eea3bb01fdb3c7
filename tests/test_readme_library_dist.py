"""README's "Your model from a library" examples run as they are (serially) and expanded on 2 ranks.

Each example prints its losses on rank 0; the expanded program under torchrun with
2 ranks (2-way tensor parallel) prints what the serial program prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from macrogen.expand import expand_source
from tests.distributed import free_port

README = Path(__file__).resolve().parent.parent / "README.md"


def examples() -> list[str]:
    text = README.read_text()
    start = text.index("## Your model from a library")
    section = text[start : text.index("\n## ", start)]  # to the next section
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run(args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(README.parent))
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_two_examples_in_the_section():
    assert len(examples()) == 2


@pytest.mark.parametrize("index", [0, 1], ids=["transformers", "built_module"])
def test_readme_library_example_matches_serial_on_two_ranks(tmp_path, index):
    pytest.importorskip("transformers")
    source = examples()[index]
    (tmp_path / "train.py").write_text(source)
    (tmp_path / "train_expanded.py").write_text(expand_source(source, path="train.py").code)
    serial = _run([sys.executable, "train.py"], tmp_path)
    parallel = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "train_expanded.py"],
        tmp_path,
    )  # fmt: skip
    assert serial.count("step") == 3
    assert parallel == serial
