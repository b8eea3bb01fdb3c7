"""tests/distributed.py's run_ranks: ranks forked from a forkserver behave as spawned ones.

The server started once, with the environment of its first call and its stdout;
each rank still sees the caller's environment and writes to the caller's output.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_ranks


def _report(rank: int, world_size: int, name: str, say: bool) -> tuple[str | None, int]:
    if say:
        print(f"rank {rank} of {world_size} says hello", flush=True)
    return os.environ.get(name), os.getppid()


def _threads_of_parent(rank: int, world_size: int) -> int:
    return len(os.listdir(f"/proc/{os.getppid()}/task"))


def test_each_call_gets_the_environment_and_output_of_its_caller(monkeypatch, capfd) -> None:
    with capfd.disabled():  # the server is up (if no test before started it), output uncaptured
        run_ranks(_report, 2, args=("MACROGEN_TEST_RUN_RANKS", False), timeout=60)
    for value in ("one", "two"):
        monkeypatch.setenv("MACROGEN_TEST_RUN_RANKS", value)
        results = run_ranks(_report, 2, args=("MACROGEN_TEST_RUN_RANKS", True), timeout=60)
        assert [env for env, _ in results] == [value, value]
        assert all(parent != os.getpid() for _, parent in results)  # not forked from pytest
    out = capfd.readouterr().out
    assert out.count("rank 0 of 2 says hello") == 2 and out.count("rank 1 of 2 says hello") == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
def test_the_server_forks_with_one_thread() -> None:
    """A fork copies only the forking thread: a lock another thread held would stay held."""
    assert run_ranks(_threads_of_parent, 2, timeout=60) == [1, 1]
