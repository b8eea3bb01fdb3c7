"""README's quick example runs as it is (serially, world size 1) and expanded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from macrogen.expand import expand_source

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_example() -> str:
    text = README.read_text()
    section = text[text.index("## A quick example") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_quick_example_runs_unexpanded_and_expanded(tmp_path: Path):
    source = quick_example()
    (tmp_path / "train.py").write_text(source)
    (tmp_path / "expanded.py").write_text(expand_source(source, path="train.py").code)
    want = "(tensor(0.2778), tensor(0.7778))\n"  # world size 1: the values as they were
    assert run(tmp_path / "train.py") == want
    assert run(tmp_path / "expanded.py") == want
