"""What bench/probes.py's battery found (issue 43's rerun), each fixed and kept fixed here.

- ``plan --model`` / ``--device-table`` on a FIFO waited for a writer forever, and on a
  100,000-deep JSON array ended in a RecursionError (exit 3);
- ``autotune FILE`` and ``verify FILE`` on a FIFO waited forever;
- ``verify FILE`` where FILE has no macros and is not Python: a SyntaxError (exit 3);
- ``verify --world-size 1e9`` started to launch 10^9 local processes.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from pathlib import Path

import pytest

from macrogen.cli import main

PLAN = ["plan", "--devices", "8xH100", "--global-batch", "16", "--seq-len", "128"]
CONFIG = '{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,'
CONFIG += ' "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}'


def _command(argv: list[str], seconds: float = 60.0) -> tuple[int, str]:
    """main(argv) in a thread, its exit status and stderr; a hang fails the test (the thread
    stays blocked on the FIFO, a daemon, and goes with the process)."""
    result: dict = {}

    def call() -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            result["code"] = main(argv)
        result["err"] = err.getvalue()

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"macrogen {' '.join(argv)}: still running after {seconds} s"
    return result["code"], result["err"]


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    Path("deep.json").write_text("[" * 100_000 + "]" * 100_000)
    Path("cfg.json").write_text(CONFIG)
    Path("garbage.json").write_text("{not json")
    return tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (PLAN + ["--model", "fifo"], "fifo: a FIFO (named pipe), not a regular file"),
        (PLAN + ["--model", "deep.json"], "deep.json: JSON nested too deeply to read"),
        (PLAN + ["--model", "cfg.json", "--device-table", "fifo"], "fifo: a FIFO (named pipe)"),
        (PLAN + ["--model", "cfg.json", "--device-table", "deep.json"], "nested too deeply"),
        (["autotune", "fifo", "--entry", ":build"], "fifo: a FIFO (named pipe), not a regular"),
        (["verify", "fifo", "--entry", ":build"], "fifo: a FIFO (named pipe), not a regular"),
        (["verify", "garbage.json", "--entry", ":build"], "garbage.json is not valid Python"),
        (["verify", "garbage.json", "--entry", ":build", "--world-size", "1e9"],
         "--world-size 1000000000: verify starts that many processes on this machine"),
    ],
    ids=["plan-model-fifo", "plan-model-deep", "plan-table-fifo", "plan-table-deep",
         "autotune-fifo", "verify-fifo", "verify-not-python", "verify-1e9-ranks"],
)  # fmt: skip
def test_a_file_or_value_the_probes_found_is_one_line_and_no_wait(files, argv, message):
    code, err = _command(argv)
    assert code in (1, 2), err
    assert message in err and "Traceback" not in err and "internal error" not in err, err
    assert len(err.strip().splitlines()) == 1, err
