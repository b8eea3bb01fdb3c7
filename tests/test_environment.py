"""Every environment variable macrogen reads is checked where it is read, and a bad value is
an error naming the variable (issue 43, items 6 and 7): ranks and sizes are ASCII digits in
range, MASTER_PORT is 1-65535, MACROGEN_TIMEOUT is at least a second, MACROGEN_BACKEND is a
backend torch knows, and a MASTER_ADDR that does not resolve fails at once."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from macrogen.runtime import environment, groups, launch, mesh

NOT_WHOLE = ["abc", "", " ", "²", "١٢", "7.0", "0x10", "1_0", "+-3"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                 groups.BACKEND_ENV, groups.TIMEOUT_ENV, mesh.SIZE_ENV):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


# -- the helper ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", NOT_WHOLE)
def test_a_whole_number_is_ascii_digits(monkeypatch, bad):
    monkeypatch.setenv("MG_TEST_NUMBER", bad)
    with pytest.raises(environment.EnvironmentValueError) as info:
        environment.whole("MG_TEST_NUMBER", 0, low=0)
    assert str(info.value).startswith(f"MG_TEST_NUMBER={bad!r}: expected a whole number")


def test_a_whole_number_in_range(monkeypatch):
    monkeypatch.setenv("MG_TEST_NUMBER", " 42 ")
    assert environment.whole("MG_TEST_NUMBER", 0, low=1, high=65535) == 42
    monkeypatch.setenv("MG_TEST_NUMBER", "99999")
    with pytest.raises(ValueError, match=r"'99999': expected a whole number from 1 to 65535"):
        environment.whole("MG_TEST_NUMBER", 0, low=1, high=65535)
    monkeypatch.delenv("MG_TEST_NUMBER")
    assert environment.whole("MG_TEST_NUMBER", 7) == 7


@pytest.mark.parametrize("bad", ["1e-9", "0.5", "0", "-3", "inf", "nan", "1e999", "²", "soon"])
def test_seconds_are_at_least_one(monkeypatch, bad):
    monkeypatch.setenv("MG_TEST_SECONDS", bad)
    with pytest.raises(
        ValueError, match=r"MG_TEST_SECONDS=.*positive number of seconds, at least 1"
    ):
        environment.seconds("MG_TEST_SECONDS")


def test_choice_names_what_is_accepted(monkeypatch):
    monkeypatch.setenv("MG_TEST_CHOICE", "RPC")
    assert environment.choice("MG_TEST_CHOICE", "p2p", ("p2p", "rpc")) == "rpc"
    monkeypatch.setenv("MG_TEST_CHOICE", "grpc")
    with pytest.raises(ValueError, match=r"MG_TEST_CHOICE='grpc': expected one of p2p, rpc"):
        environment.choice("MG_TEST_CHOICE", "p2p", ("p2p", "rpc"))


# -- where macrogen reads them ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"])
@pytest.mark.parametrize("bad", ["abc", ""])
def test_placement_names_a_bad_rank_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError) as info:
        groups.placement()
    assert str(info.value).startswith(f"{name}={bad!r}: expected a whole number")


def test_launch_names_a_bad_local_rank_before_anything_starts(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(ValueError, match=r"^LOCAL_RANK='abc': expected a whole number"):
        launch.launch()


def _torchrun_env(monkeypatch, **values: str) -> None:
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in {**base, **values}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "name,bad,expected",
    [
        ("RANK", "abc", "whole number >= 0"),
        ("RANK", "", "whole number >= 0"),
        ("WORLD_SIZE", "²", "whole number from 1 to 2147483647"),
        ("MASTER_PORT", "99999", "whole number from 1 to 65535"),
        ("MASTER_PORT", "0", "whole number from 1 to 65535"),
        ("TORCHELASTIC_RESTART_COUNT", "x", "whole number >= 0"),
    ],
)
def test_the_start_up_names_a_bad_variable_before_any_connection(monkeypatch, name, bad, expected):
    _torchrun_env(monkeypatch, **{name: bad})
    with pytest.raises(groups.StartupError) as info:
        groups._attempt_store(groups.Placement("gloo", "cpu", None))
    assert str(info.value) == f"{name}={bad!r}: expected a {expected}"


def _bounded(fn, seconds: float):
    result: dict = {}

    def call():
        try:
            fn()
        except BaseException as e:
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s"
    return result.get("error"), time.monotonic() - started


@pytest.mark.parametrize("host", ["no-such-host.invalid", ""])
def test_a_master_addr_that_does_not_resolve_fails_at_once(monkeypatch, host):
    """Without MACROGEN_TIMEOUT torch would retry the lookup for 30 minutes."""
    _torchrun_env(monkeypatch, MASTER_ADDR=host, RANK="1")
    error, took = _bounded(lambda: groups._attempt_store(groups.Placement("gloo", "cpu", None)), 30)
    assert isinstance(error, groups.StartupError), error
    assert str(error).startswith("MASTER_ADDR"), error
    print(f"{host!r}: {error} ({took:.1f} s)")


def test_the_tensor_parallel_size_is_ascii_digits(monkeypatch):
    monkeypatch.setenv(mesh.SIZE_ENV, "²")  # passes str.isdigit(), fails int()
    with pytest.raises(ValueError, match=r"^MACROGEN_TP_SIZE='²': expected a whole number >= 1"):
        mesh.tensor_parallel_size(None, 4)
    monkeypatch.setenv(mesh.SIZE_ENV, " ")
    assert mesh.tensor_parallel_size(None, 4) == 1  # blank: unset


@pytest.mark.parametrize("bad", ["1e-9", "0.5"])
def test_a_timeout_under_a_second_is_refused(monkeypatch, bad):
    monkeypatch.setenv(groups.TIMEOUT_ENV, bad)
    with pytest.raises(ValueError, match=rf"^MACROGEN_TIMEOUT='{bad}': expected a positive"):
        groups.timeout()
    monkeypatch.setenv(groups.TIMEOUT_ENV, "1")
    assert groups.timeout() == datetime.timedelta(seconds=1)


def test_an_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv(groups.BACKEND_ENV, "mpi2")
    with pytest.raises(ValueError, match=r"^MACROGEN_BACKEND='mpi2': 'mpi2' is not a backend"):
        groups.placement()


def test_the_server_transport_is_one_of_two(monkeypatch):
    from macrogen.runtime import param_server

    monkeypatch.setenv(param_server.TRANSPORT_ENV, "tcp")
    with pytest.raises(ValueError, match=r"^MACROGEN_SERVER_TRANSPORT='tcp': expected one of p2p"):
        environment.choice(param_server.TRANSPORT_ENV, "p2p", param_server.TRANSPORTS)


def test_a_switch_is_on_or_off_and_nothing_else(monkeypatch):
    from macrogen import hook

    for on in ("1", "true", "YES", "on"):
        monkeypatch.setenv(hook.DISABLE_ENV, on)
        assert hook.disabled()
    for off in ("0", "false", "no", "OFF", "", " "):
        monkeypatch.setenv(hook.DISABLE_ENV, off)
        assert not hook.disabled()
    monkeypatch.setenv(hook.SHOW_ENV, "maybe")
    with pytest.raises(ValueError, match=r"^MACROGEN_SHOW_EXPANDED='maybe': expected 1 or 0"):
        hook.options()


def _bound(fd: int | None) -> str | None:
    import socket

    if fd is None:
        return None
    with socket.socket(fileno=fd) as s:
        return s.getsockname()[0]


def test_the_store_macrogen_hosts_listens_on_master_addr_only(monkeypatch):
    """Not on every interface; and not on a loopback a host name resolves to here, where the
    job may span machines that resolve it otherwise (torch then binds as it does)."""
    import socket

    assert _bound(groups._listener_on("127.0.0.1", 0, 2)) == "127.0.0.1"
    name = socket.gethostname()
    if socket.gethostbyname(name).startswith("127."):  # Debian's /etc/hosts
        assert groups._listener_on(name, 0, 2) is None  # LOCAL_WORLD_SIZE unset: maybe several
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert _bound(groups._listener_on(name, 0, 2)) == socket.gethostbyname(name)
    assert groups._listener_on("192.0.2.123", 0, 2) is None  # no address of this machine
