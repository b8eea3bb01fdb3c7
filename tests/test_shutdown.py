"""The exit's wait for other threads (runtime/shutdown.py): gloo's workers put down the last
collective's tensors before the interpreter finalizes."""

from __future__ import annotations

import threading
import time

from macrogen.runtime import shutdown


def test_settles_beside_a_sleeping_thread():
    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait, daemon=True)
    sleeper.start()
    try:
        start = time.monotonic()
        assert shutdown.settle(limit_s=5.0)
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()


def test_a_busy_thread_bounds_the_wait():
    stop = threading.Event()

    def spin() -> None:  # a thread of the program that never blocks
        while not stop.is_set():
            sum(range(1000))

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    try:
        time.sleep(0.01)
        assert shutdown.others_running() is not None
        start = time.monotonic()
        assert not shutdown.settle(limit_s=0.2)
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        busy.join()


def test_registered_once(monkeypatch):
    seen = []
    monkeypatch.setattr(shutdown.atexit, "register", seen.append)
    monkeypatch.setattr(shutdown, "_registered", False)
    shutdown.at_exit()
    shutdown.at_exit()
    assert seen == [shutdown._exit]
