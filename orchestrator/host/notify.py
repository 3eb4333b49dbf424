"""sd_notify without libsystemd: readiness, status line and the watchdog for `Type=notify` units.

The protocol is one datagram of newline-separated KEY=VALUE lines sent to the AF_UNIX socket named
by $NOTIFY_SOCKET (a path, or `@name` for a Linux abstract socket). Outside systemd the variable is
unset and every method is a no-op, so callers never need to check.

Watchdog design: systemd restarts the unit when WATCHDOG=1 stops arriving for WatchdogSec. That
only detects a hung supervisor if the ping is tied to the main loop's forward progress, so the
ping is sent *from* the loop: the loop calls `Heartbeat.ping_if_due()` once per pass (and long
steps call it from their progress callback, and deliberate sleeps use `Heartbeat.wait()`). There is
deliberately no background timer thread: a thread would keep pinging while the loop is stuck,
and systemd would never notice.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# Variables systemd gives the main process only. Children (the trainer) must not inherit them:
# with NotifyAccess=main their messages are ignored, and a library that calls sd_notify would
# only add journal noise.
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

_STATUS_MAX = 1024  # one journal-friendly line; systemctl status shows it verbatim


def socket_address(value: str | None) -> str | bytes | None:
    """$NOTIFY_SOCKET -> an address for sendto(): a path, or b"\\0name" for `@name` (abstract)."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock:/relative forms are not used by a system manager for a service


def watchdog_interval_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """How often to ping: half of WatchdogSec (what sd_watchdog_enabled() recommends), or None
    when no watchdog is armed for this process (unset, malformed, or WATCHDOG_PID is another pid)."""
    env = os.environ if env is None else env
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID", "").strip()
    if owner:
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None  # inherited from a parent: the watchdog is not ours
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` without the variables meant for the supervisor only (for launching the trainer)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in SYSTEMD_ONLY_ENV}


class Notifier:
    """Sends sd_notify messages. Never raises: the first send error is logged as a warning, later
    ones at debug level (a vanished socket must not take the supervisor down)."""

    def __init__(self, address: str | bytes | None = None, *, timeout_s: float = 1.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        return cls(socket_address(env.get("NOTIFY_SOCKET")))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of KEY=VALUE lines; True when it was handed to the socket."""
        if self.address is None or not lines:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Bounded: a full receive queue must not stall the main loop (a lost ping is
                # retried on the next pass).
                self._sock.settimeout(self._timeout_s)
            self._sock.sendto("\n".join(lines).encode("utf-8", "replace"), self.address)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %r failed (%s); further failures are logged at debug level",
                            self.address, e)
            else:
                log.debug("sd_notify to %r failed: %s", self.address, e)
            self.close()  # reconnect on the next send: systemd may have been re-executed
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([_status_line(status)] if status else []))

    def status(self, text: str) -> bool:
        return self.send(_status_line(text))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([_status_line(status)] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more of the current start/stop timeout (a long restore or final sync)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def _status_line(text: str) -> str:
    # STATUS= is a single line: a newline would start a new (bogus) KEY=VALUE assignment.
    flat = " ".join(str(text).split())
    return "STATUS=" + flat[:_STATUS_MAX]


_FROM_ENV = object()


class Heartbeat:
    """The watchdog ping, driven by the main loop: call `ping_if_due(now)` once per pass.

    Sends WATCHDOG=1 when `interval_s` has passed since the last ping (the first call pings at
    once); `interval_s` defaults to watchdog_interval_s() from the environment, and None disables
    it. `now` comes from `clock` (default time.time, the supervisor's clock); if it goes backwards
    (a wall-clock step, or a caller mixing clocks) the ping is sent rather than held back.
    The loop must come round more often than WatchdogSec - interval_s; a step that legitimately
    blocks longer calls `ping_if_due()` as it makes progress, and a deliberate sleep uses `wait()`.
    """

    def __init__(self, notifier: Notifier, interval_s: float | None | object = _FROM_ENV, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.notifier = notifier
        self.interval_s: float | None = watchdog_interval_s() if interval_s is _FROM_ENV else interval_s
        self._clock = clock
        self._last: float | None = None
        self.sent = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 clock: Callable[[], float] = time.time) -> Heartbeat:
        return cls(Notifier.from_env(env), watchdog_interval_s(env), clock=clock)

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None and self.notifier.enabled

    def ping_if_due(self, now: float | None = None) -> bool:
        if not self.enabled:
            return False
        now = self._clock() if now is None else now
        if self._last is not None and 0 <= now - self._last < self.interval_s:
            return False
        self._last = now
        if self.notifier.watchdog():
            self.sent += 1
            return True
        return False

    def wait(self, event: threading.Event, timeout_s: float,
             tick: Callable[[], object] | None = None) -> bool:
        """`event.wait(timeout_s)` for the main loop that keeps pinging: a deliberate wait (the
        settle time after a crash, a backoff) is the loop working, not the loop stuck. `tick` runs
        after each slice (at most 1 s), e.g. to poll the spot notice. Returns event.is_set()."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        step = min(1.0, self.interval_s / 2) if self.interval_s else 1.0
        while True:
            self.ping_if_due()
            remaining = deadline - time.monotonic()
            if event.is_set() or remaining <= 0:
                return event.is_set()
            if event.wait(min(step, remaining)):
                return True
            if tick is not None:
                tick()
