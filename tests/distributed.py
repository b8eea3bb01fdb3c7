"""Run a function on N gloo ranks on 127.0.0.1, with a bounded time.

    results = run_ranks(worker, world_size=2, args=(seed,), timeout=120)

``worker(rank, world_size, *args)`` runs in a fresh process with the default
process group initialized (gloo) and torchrun's environment variables set, so
expanded code finds the group as it would under torchrun. Its return value
(picklable) comes back per rank; an exception on any rank fails the call with
that rank's traceback; a rank that does not finish in ``timeout`` seconds fails
the call instead of hanging the test suite.

Ranks are forked from a forkserver that has imported torch once (a fresh
interpreter, not this process), instead of each starting an interpreter that
imports torch: a spawn took ~4 s on 2 cores, a fork from the server ~0.1 s.
The server started with the environment of the first call, so each rank takes
this process's environment as it is at its call (as a spawned rank would).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What ranks import anyway (_entry, macrogen.runtime, the transformers models the tests
# build): the forkserver imports it once, ~3 s a rank less on 2 cores. None of it reads at
# import the environment variables tests set, and none starts a thread (a fork copies only
# the forking thread; test_run_ranks checks the server has one).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]


class _Stdio:
    """This process's stdout and stderr as they are at the call (pytest's capture of the test
    that runs it), for a rank: forked from the server, it would write to the server's."""

    def __reduce__(self):  # pickled as the rank starts: the fds travel to the forkserver
        return _redirect, (reduction.DupFd(1), reduction.DupFd(2))


def _redirect(out, err) -> None:
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue,
    init: bool,
    environ: dict[str, str],
    stdio: None,  # (_Stdio: redirected as it was unpickled)
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    *,
    timeout: float = 180,
    init: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, args, queue, init, environ, _Stdio()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f} s"
                ) from None
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break  # the other ranks may now hang in a collective; don't wait for them
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]


def _script(rank: int, world_size: int, script: str, argv: list[str], env: dict) -> None:
    import runpy
    import sys

    os.environ.update(env)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # exit(0) is a rank's success (a parameter server's, when done)
        if e.code not in (None, 0):
            raise


def run_script(
    script: str, argv: list[str], world_size: int, *, env: dict | None = None, timeout: float = 180
) -> None:
    """``python script *argv`` on ``world_size`` ranks with torchrun's rank variables (and
    ``env``), as one attempt of ``torchrun --nproc-per-node world_size`` runs it, without the
    agent (no restarts) and in a fraction of its start-up time. The script makes its group."""
    run_ranks(_script, world_size, args=(script, argv, env or {}), timeout=timeout, init=False)
