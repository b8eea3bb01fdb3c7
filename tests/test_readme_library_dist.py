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


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(README.parent))
    return subprocess.Popen(
        args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _output(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return out


def test_two_examples_in_the_section():
    assert len(examples()) == 2


@pytest.mark.parametrize("index", [0, 1], ids=["transformers", "built_module"])
def test_readme_library_example_matches_serial_on_two_ranks(tmp_path, index):
    pytest.importorskip("transformers")
    source = examples()[index]
    (tmp_path / "train.py").write_text(source)
    (tmp_path / "train_expanded.py").write_text(expand_source(source, path="train.py").code)
    # side by side: each spends seconds importing on one core
    serial = _start([sys.executable, "train.py"], tmp_path)
    parallel = _start(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "train_expanded.py"],
        tmp_path,
    )  # fmt: skip
    serial, parallel = _output(serial), _output(parallel)
    assert serial.count("step") == 3
    assert parallel == serial
