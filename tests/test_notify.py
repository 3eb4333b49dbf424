"""sd_notify against a real AF_UNIX datagram socket, and the watchdog's tie to the main loop."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

import pytest

from orchestrator.host.notify import Heartbeat, Notifier, child_env, socket_address, watchdog_interval_s


@pytest.fixture
def listener(tmp_path):
    """A bound datagram socket standing in for systemd's notify socket; yields (sock, NOTIFY_SOCKET)."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield sock, str(path)
    sock.close()


def recv(sock: socket.socket, timeout: float = 2.0) -> str:
    sock.settimeout(timeout)
    return sock.recv(65536).decode()


def drain(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(65536).decode())
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)
    return out


def test_messages_arrive(listener):
    sock, addr = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": addr})
    assert n.enabled
    assert n.ready()
    assert recv(sock) == "READY=1"
    assert n.status("step 120/5000, loss 1.93")
    assert recv(sock) == "STATUS=step 120/5000, loss 1.93"
    assert n.watchdog()
    assert recv(sock) == "WATCHDOG=1"
    assert n.stopping()
    assert recv(sock) == "STOPPING=1"
    assert n.extend_timeout(2.5)
    assert recv(sock) == "EXTEND_TIMEOUT_USEC=2500000"
    n.close()


def test_ready_with_status_is_one_datagram_and_status_is_one_line(listener):
    sock, addr = listener
    n = Notifier(socket_address(addr))
    n.ready("supervising\nattempt 3")
    assert recv(sock) == "READY=1\nSTATUS=supervising attempt 3"
    n.status("x" * 5000)
    assert len(recv(sock)) == len("STATUS=") + 1024


def test_abstract_socket():
    name = f"orchestrator-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.address == b"\0" + name.encode()
        assert n.ready()
        assert recv(sock) == "READY=1"
    finally:
        sock.close()


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "relative/path"}])
def test_noop_without_notify_socket(env):
    n = Notifier.from_env(env)
    assert not n.enabled
    assert n.ready() is False and n.status("x") is False and n.watchdog() is False and n.stopping() is False
    hb = Heartbeat.from_env({**env, "WATCHDOG_USEC": "100000"})
    assert not hb.enabled and hb.ping_if_due() is False


def test_from_env_defaults_to_process_environment(monkeypatch, listener):
    sock, addr = listener
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    assert Notifier.from_env().ready() and recv(sock) == "READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not Notifier.from_env().enabled


def test_send_error_is_swallowed_and_warned_once(tmp_path, caplog):
    n = Notifier(str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.DEBUG, logger="orchestrator.host.notify"):
        assert n.ready() is False
        assert n.watchdog() is False
        assert n.status("x") is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sd_notify" in warnings[0].getMessage()


def test_recovers_when_socket_comes_back(tmp_path):
    path = tmp_path / "late.sock"
    n = Notifier(str(path))
    assert n.watchdog() is False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        assert n.watchdog() is True
        assert recv(sock) == "WATCHDOG=1"
    finally:
        sock.close()


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": ""}, None),
    ({"WATCHDOG_USEC": "abc"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "120000000"}, 60.0),
    ({"WATCHDOG_USEC": "100000"}, 0.05),
    ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "SELF"}, 60.0),
    ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "1"}, None),   # someone else's watchdog
    ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "x"}, None),
])
def test_watchdog_interval(env, expected):
    env = {k: (str(os.getpid()) if v == "SELF" else v) for k, v in env.items()}
    got = watchdog_interval_s(env)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_watchdog_interval_explicit_pid():
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "42"}, pid=42) == 1.0


def test_child_env_drops_systemd_variables():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert child_env(env) == {"PATH": "/bin"}


def test_heartbeat_rate_limited_with_injected_clock(listener):
    sock, addr = listener
    hb = Heartbeat(Notifier(addr), interval_s=10.0)
    assert hb.ping_if_due(100.0) is True          # first pass pings at once
    assert hb.ping_if_due(105.0) is False
    assert hb.ping_if_due(109.9) is False
    assert hb.ping_if_due(110.0) is True
    assert hb.ping_if_due(111.0) is False
    assert hb.sent == 2
    assert drain(sock) == ["WATCHDOG=1", "WATCHDOG=1"]


def test_heartbeat_disabled_without_watchdog(listener):
    sock, addr = listener
    hb = Heartbeat.from_env({"NOTIFY_SOCKET": addr})
    assert not hb.enabled
    assert hb.ping_if_due(0.0) is False
    assert drain(sock) == []


def test_pings_stop_when_main_loop_is_stuck(listener):
    """A loop that pings each pass and then hangs: pings arrive while it runs, none after."""
    sock, addr = listener
    env = {"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "100000"}   # WatchdogSec=0.1s -> ping every 0.05s
    hb = Heartbeat.from_env(env)
    assert hb.interval_s == pytest.approx(0.05)
    running_for = 0.4
    stuck, release = threading.Event(), threading.Event()

    def main_loop():
        start = time.monotonic()
        while time.monotonic() - start < running_for:
            hb.ping_if_due()
            time.sleep(0.005)                # the rest of a pass
        stuck.set()
        release.wait(10)                     # the loop hangs here (a wedged syscall, a deadlock)

    t = threading.Thread(target=main_loop, daemon=True)
    t.start()
    pings = [recv(sock)]                     # the first pass pings at once...
    assert not stuck.is_set()                # ...while the loop is still running
    assert stuck.wait(5)
    pings += drain(sock)                     # the rest, all sent before the loop blocked
    assert pings and set(pings) == {"WATCHDOG=1"}
    assert len(pings) >= 4                   # ~0.4s / 0.05s = 8 while running

    sock.settimeout(4 * hb.interval_s)       # > 2 intervals (and > WatchdogSec) with the loop stuck
    with pytest.raises(TimeoutError):
        sock.recv(64)
    assert hb.sent == len(pings)

    release.set()
    t.join(5)


def test_heartbeat_interval_defaults_to_environment(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Heartbeat(Notifier(None)).interval_s == 2.0        # how the supervisor builds it
    assert Heartbeat(Notifier(None), None).interval_s is None  # explicit: no watchdog
    monkeypatch.delenv("WATCHDOG_USEC")
    assert Heartbeat(Notifier(None)).interval_s is None


def test_heartbeat_pings_when_clock_goes_backwards(listener):
    sock, addr = listener
    hb = Heartbeat(Notifier(addr), interval_s=10.0)
    assert hb.ping_if_due(1_000.0)
    assert hb.ping_if_due(400.0)        # wall clock stepped back: never hold the ping for 600 s
    assert not hb.ping_if_due(405.0)
    assert drain(sock) == ["WATCHDOG=1", "WATCHDOG=1"]


def test_wait_keeps_pinging_through_a_deliberate_wait(listener):
    sock, addr = listener
    hb = Heartbeat.from_env({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "100000"})
    ticks = []
    t0 = time.monotonic()
    assert hb.wait(threading.Event(), 0.4, tick=lambda: ticks.append(1)) is False   # 4x WatchdogSec
    assert time.monotonic() - t0 >= 0.4
    pings = drain(sock)
    assert len(pings) >= 5 and ticks                      # ~every 0.05 s, no gap > WatchdogSec

    ev = threading.Event()
    threading.Timer(0.1, ev.set).start()
    t0 = time.monotonic()
    assert hb.wait(ev, 30) is True
    assert time.monotonic() - t0 < 5                      # returns as soon as the event is set


def test_wait_without_watchdog_is_a_plain_wait():
    hb = Heartbeat(Notifier(None), None)
    ev = threading.Event()
    ev.set()
    assert hb.wait(ev, 10) is True
    assert hb.wait(threading.Event(), 0.05) is False
