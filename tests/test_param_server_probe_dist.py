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
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import run_script
from tests.param_server_probe_train import serial

SCRIPT = str(Path(__file__).with_name("param_server_probe_train.py"))
WILDCARDS = ("0.0.0.0", "::")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="Linux's /proc")


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _address(hexaddr: str, v6: bool) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if v6:  # four 32-bit words, each in host (little-endian) order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that these processes hold."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table, v6 in (("tcp", False), ("tcp6", True)):
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                        found.append((pid, *_address(fields[1], v6)))
    return found


def _junk(host: str, port: int) -> None:
    host = "127.0.0.1" if host in WILDCARDS else host
    payloads = [os.urandom(320), b"\xff" * 320, os.urandom(64 * 1024), b"\x00" * 8 + b"\xff" * 8]
    for payload in payloads:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(payload)
                time.sleep(0.02)
        except OSError:
            pass  # refused or reset: the port did not take it, which is fine


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
            _junk(host, port)
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
