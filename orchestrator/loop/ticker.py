"""What the loop does on every pass whatever the state, and how it waits.

    housekeeping()  the per-pass housekeeping: the watchdog's heartbeat, metrics, journal writes a full disk held,
                    the publisher's figures, published copies a set-aside still has to move, the running attempt's progress and the goodput (every 10 s), a
                    spot interruption notice (a stop request)
    sleep(s)        a deliberate wait, interruptible by a stop, reporting meanwhile
    span(kind)      a `with` block whose time goes into the goodput account, recorded however the block ends
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from orchestrator.host.base import Host
from orchestrator.host.journal import Journal
from orchestrator.host.journal_goodput import goodput_of
from orchestrator.host.metrics import Metrics
from orchestrator.host.notify import Heartbeat
from orchestrator.host.spot import SpotNotice
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.store.publisher import Publisher

WAIT_SLICE_S = 1.0
GOODPUT_EVERY_S = 10.0


class Ticker:
    def __init__(self, host: Host, journal: Journal, publisher: Publisher, metrics: Metrics, heartbeat: Heartbeat,
                 spot: SpotNotice, stop_event: threading.Event, request_stop: Callable[[str], None],
                 running_attempt: Callable[[], AttemptWatch | None],
                 retry_set_asides: Callable[[], object] = lambda: None):
        """`running_attempt`: the attempt whose live progress goes into the journal and the goodput;
        `retry_set_asides`: moves the published copies pending set-asides still name (the sync lock may have been
        held by a round)."""
        self.host, self.journal, self.publisher, self.metrics = host, journal, publisher, metrics
        self.heartbeat, self.spot, self.stop_event, self.request_stop = heartbeat, spot, stop_event, request_stop
        self.running_attempt = running_attempt
        self.retry_set_asides = retry_set_asides
        self.goodput_at = float("-inf")  # monotonic time of the last goodput figure

    def housekeeping(self, goodput_now: bool = False) -> None:
        """Does the per-pass housekeeping (see the module docstring); `goodput_now` forces the goodput figure."""
        now, mono = self.host.now(), self.host.monotonic()
        self.heartbeat.ping_if_due(mono)
        self.metrics.tick(now)
        if self.journal.held and self.journal.flush():
            self.journal.event("disk_full", "journal writes held while the disk was full are recorded now")
        self.publisher.report()
        self.retry_set_asides()
        if goodput_now or mono - self.goodput_at >= GOODPUT_EVERY_S:
            self.goodput_at = mono
            a = self.running_attempt()
            if a and a.first_step_at and a.open and a.last:  # live progress of the running attempt
                a.record(self.journal, replace(a.row, first_step_at=a.first_step_at, last_step_at=a.last_step_at,
                                               end_step=a.last.step))
            g = goodput_of(self.journal, now)
            self.metrics.goodput(g.ratio, g.lost)
        reason = self.spot.check(now)
        if reason:
            self.request_stop(f"spot interruption: {reason}")

    def sleep(self, seconds: float) -> bool:
        """Waits `seconds`, interruptible by a stop, reporting meanwhile (watchdog, spot notice). Returns True
        when a stop cut it short."""
        deadline = self.host.monotonic() + max(0.0, seconds)
        while not self.stop_event.is_set():
            remaining = deadline - self.host.monotonic()
            if remaining <= 0:
                return False
            if self.host.wait(self.stop_event, min(WAIT_SLICE_S, remaining)):
                break
            self.housekeeping()
        return True

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Records the block's time as a goodput span of `kind`, on every way out of it."""
        started = self.host.now()
        try:
            yield
        finally:
            self.journal.span(started, self.host.now(), kind)
