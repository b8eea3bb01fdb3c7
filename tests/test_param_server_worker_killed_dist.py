"""A worker SIGKILLed mid-run: the server rank ends with its one-line error and exit status 1.

Three plain processes (no torchrun, so no agent tears the job down first): ranks 0 and 1
are workers, rank 2 the server (tests/param_server_kill_train.py); worker 1 SIGKILLs
itself at step 1. The server's reader for worker 1 sees the connection end while the
reader for worker 0 is still blocked in ``recv``; the server must say which worker
stopped and exit 1, not abort (SIGABRT, "terminate called without an active exception")
while the interpreter finalizes around the blocked thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port

SCRIPT = Path(__file__).with_name("param_server_kill_train.py")


@pytest.mark.timeout(180)
def test_server_exits_one_line_when_a_worker_is_killed(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "CKPT_TEST_TIMEOUT": "150"}  # fmt: skip
        cmd = [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "ckpt"),
               "--out", str(tmp_path / "out.pt"), "--kill", "1:1", "--every", "1000"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    worker0, worker1, server = procs
    try:
        _, err = server.communicate(timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert worker1.returncode == -signal.SIGKILL
    assert "terminate called" not in err, err[-3000:]
    assert server.returncode == 1, f"server exit status {server.returncode}:\n{err[-3000:]}"
    assert "rank 2: parameter server: worker 1 (rank 1): stopped" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
