"""The opt-in RPC transport's listening interface (param_server_rpc._interface): loopback
for a job on one machine, the interface that reaches MASTER_ADDR otherwise; never "any"."""

from __future__ import annotations

import socket

import pytest

from macrogen.runtime import param_server_rpc


def _set(monkeypatch, master: str, world: str, local: str | None) -> None:
    monkeypatch.setenv("MASTER_ADDR", master)
    monkeypatch.setenv("WORLD_SIZE", world)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)


def _external() -> tuple[str, str] | None:
    """A non-loopback interface of this machine with an IPv4 address, if any."""
    for _, name in socket.if_nameindex():
        address = param_server_rpc._address_of(name)
        if address and not address.startswith("127."):
            return name, address
    return None


def test_every_rank_on_this_machine_listens_on_loopback(monkeypatch):
    loopback = next(
        n for _, n in socket.if_nameindex() if param_server_rpc._address_of(n) == "127.0.0.1"
    )
    _set(monkeypatch, "127.0.0.1", "4", None)
    assert param_server_rpc._interface() == loopback
    external = _external()
    if external is not None:  # MASTER_ADDR names this machine, and every rank is local
        _set(monkeypatch, external[1], "3", "3")
        assert param_server_rpc._interface() == loopback


def test_a_job_on_several_machines_listens_where_it_reaches_master(monkeypatch):
    external = _external()
    if external is None:
        pytest.skip("no network interface besides loopback")
    _set(monkeypatch, external[1], "4", "2")
    assert param_server_rpc._interface() == external[0]
