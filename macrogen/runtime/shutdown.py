"""A distributed program's exit, without gloo aborting it.

torch 2.13's ``destroy_process_group`` does not stop a gloo group's worker threads: they run
until the last reference to the group goes, which is often in the interpreter's own
shutdown (a model, a ``DeviceMesh`` or a module global still holds it). A worker that
finished the program's last collective releases that collective's tensors a moment after
the caller's ``wait()`` returned; releasing a tensor whose Python object the program already
dropped needs the GIL, and a thread taking the GIL once the interpreter is finalizing is
made to exit from inside C++ code that cannot unwind: ``terminate called without an active
exception``, SIGABRT, a nonzero exit status after a run that did all its work (seen ~1 run in
7 of a 2-rank gloo program under load, and ~1 in 80 of ``examples/run.py``; torch's own fix,
pytorch/pytorch#179291, was abandoned).

So, at exit, while the interpreter can still hand out the GIL: the default group is
destroyed if the program left it (macrogen's or the program's own: ``mg.launch`` registers
this too), and the process waits, with the GIL released, until no other thread of it is
running: the workers have put their last collective down (measured: a 2-rank gloo program
holding its groups to the end aborted in 7 of 40 runs under load, and in 0 of 60 with
this). Bounded: a program with a busy thread of its own waits ``LIMIT_S``, once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time

import torch.distributed as dist

LIMIT_S = 1.0  # the longest the exit waits for other threads to settle
POLL_S = 0.002  # between looks at the threads (the GIL released meanwhile)
QUIET = 3  # looks in a row with no other thread running
_registered = False


def at_exit() -> None:
    """Register the exit's clean-up once per process (``mg.launch``, the group macrogen made)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_exit)


def _exit() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    settle()


def settle(limit_s: float = LIMIT_S) -> bool:
    """Wait, the GIL released, until no other thread of this process is running (True), or
    ``limit_s`` passed (False)."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < QUIET:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
        running = others_running()
        if running is None:  # no /proc: one short wait instead
            time.sleep(limit_s / 10)
            return True
        quiet = 0 if running else quiet + 1
    return True


def others_running() -> int | None:
    """How many of this process's other threads are running or runnable (None: unknown)."""
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] == "R":  # the state follows the name in parentheses
            count += 1
    return count
