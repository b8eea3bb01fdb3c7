"""Starting verify's ranks: torchrun on this machine by default, anything else through ``Launch``.

    ranks = torchrun(job, world_size=2, timeout=300)   # started: ranks import torch meanwhile
    ...                                                # the serial step runs here
    ranks.wait()                                       # RanksFailed if they did not finish well

Each rank runs ``macrogen.verify.rank`` on the job file (tests start the same function on
ranks forked from their own server: a ``Launch`` of theirs).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class RanksFailed(Exception):
    """The ranks exited badly or ran out of time (the message says which)."""


class Started(Protocol):
    def wait(self) -> None:
        """Until every rank is done; RanksFailed unless all exited well in time."""

    def stop(self) -> None:
        """End every rank now (the serial step failed: nothing to compare with)."""


# (job file, world size, timeout in seconds) -> the ranks, started
Launch = Callable[[Path, int, float], Started]


class _Torchrun:
    def __init__(self, job: Path, world_size: int, timeout: float):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={world_size}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "macrogen.verify.rank",
            str(job),
        ]
        # one thread a rank unless the user says otherwise (torchrun would warn that it chose)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.job, self.world_size, self.timeout = job, world_size, timeout
        self.deadline = time.monotonic() + timeout
        self.log = job.parent / "ranks.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # so torchrun and its ranks can be ended together
            )

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            raise RanksFailed(
                f"the {self.world_size} ranks did not finish in {self.timeout:g} s (--timeout)"
            ) from None
        finally:
            self.stop()
        if self.proc.returncode != 0:
            text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
            tail = [line for line in text if line.strip() and not line.startswith("*****")]
            raise RanksFailed(
                f"the ranks exited with status {self.proc.returncode}: {' | '.join(tail[-4:])}"
            )

    def stop(self) -> None:
        from macrogen.autotune.measure import _end  # torchrun's group, then each rank by pid

        _end(self.proc, self.job.parent)


def torchrun(job: Path, world_size: int, timeout: float) -> Started:
    """``macrogen.verify.rank`` on ``world_size`` local ranks: torchrun on 127.0.0.1 at a
    free port; ``wait()`` ends them all after ``timeout`` seconds from now."""
    return _Torchrun(job, world_size, timeout)
