"""A parameter-server job trusts no network input (issue 43, item 1).

A 2-worker + 1-server job (tests/param_server_probe_train.py, started by macrogen's own
start-up as an expanded program is) stops at a gate mid-training; the test reads every TCP
port its processes listen on from /proc, checks that none listens on every interface, sends
each port junk (the 320 random bytes that aborted the RPC job, 0xff bytes, 64 KiB), opens
the gate, and the job must still train to the serial program's tables and parameters.
With the opt-in RPC transport, the listeners are on loopback, never every interface.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from bench.probes.sockets import WILDCARDS, listeners, send_junk
from tests.distributed import run_script
from tests.param_server_probe_train import serial

SCRIPT = str(Path(__file__).with_name("param_server_probe_train.py"))
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="Linux's /proc")


def _start(tmp: Path, transport: str) -> tuple[threading.Thread, dict]:
    gate = tmp / "gate"
    gate.mkdir()
    outcome: dict = {}
    argv = ["--gate", str(gate), "--out", str(tmp / "state.pt"), "--transport", transport]

    def job() -> None:
        try:
            run_script(SCRIPT, argv, 3, env={"PROBE_TEST_TIMEOUT": "100"}, timeout=120)
        except BaseException as e:  # handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    deadline = time.monotonic() + 100
    wanted = [gate / n for n in ("pid_0", "pid_1", "pid_2", "ready_0", "ready_1")]
    while not all(p.exists() for p in wanted):
        assert time.monotonic() < deadline and thread.is_alive(), outcome.get("error")
        time.sleep(0.05)
    outcome["pids"] = [int((gate / f"pid_{r}").read_text()) for r in range(3)]
    outcome["gate"] = gate
    return thread, outcome


def _finish(thread: threading.Thread, outcome: dict) -> None:
    (outcome["gate"] / "go").write_text("")
    thread.join(130)
    assert not thread.is_alive(), "the job did not finish"
    if "error" in outcome:
        raise outcome["error"]


def test_junk_on_every_port_of_a_server_job_leaves_it_training_to_the_serial_result(tmp_path):
    thread, outcome = _start(tmp_path, "p2p")
    try:
        ports = listeners(outcome["pids"])
        print(f"listeners of the job's processes: {ports}")
        assert ports, "the job listens nowhere? (the probe would prove nothing)"
        assert not [p for p in ports if p[1] in WILDCARDS], f"a wildcard listener: {ports}"
        for _, host, port in ports:
            send_junk(host, port)
    finally:
        _finish(thread, outcome)
    got, want = torch.load(tmp_path / "state.pt"), serial(6)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=key)
    assert int(got["emb.step"]) == 6


def test_the_rpc_transport_listens_on_loopback_only(tmp_path):
    """Asked for (transport="rpc"): TensorPipe and its rendezvous bind no wildcard address.
    (No junk here: RPC unpickles what it receives; docs/async.md says whom it trusts.)"""
    thread, outcome = _start(tmp_path, "rpc")
    try:
        ports = listeners(outcome["pids"])
        print(f"listeners of the job's processes: {ports}")
        assert ports and all(host == "127.0.0.1" for _, host, _ in ports), ports
    finally:
        _finish(thread, outcome)
    got, want = torch.load(tmp_path / "state.pt"), serial(6)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=key)
