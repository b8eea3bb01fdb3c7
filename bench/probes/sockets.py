"""The TCP listeners of a set of processes, from Linux's /proc (what ``ss -ltnp`` shows)."""

from __future__ import annotations

import os
import socket
import time

WILDCARDS = ("0.0.0.0", "::")


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
    """(pid, address, port) of every TCP socket in LISTEN state these processes hold."""
    found = []
    for pid in pids:
        try:
            inodes = _socket_inodes(pid)
        except OSError:
            continue
        for table, v6 in (("tcp", False), ("tcp6", True)):
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                        found.append((pid, *_address(fields[1], v6)))
    return found


def send_junk(host: str, port: int) -> None:
    """The 320 random bytes that aborted the RPC job, 0xff bytes, 64 KiB, a bogus header."""
    host = "127.0.0.1" if host in WILDCARDS else host
    for payload in (os.urandom(320), b"\xff" * 320, os.urandom(64 * 1024), b"\0" * 8 + b"\xff" * 8):
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(payload)
                time.sleep(0.02)
        except OSError:
            pass  # refused or reset: the port did not take it, which is fine
