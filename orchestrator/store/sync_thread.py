"""The publisher's thread: a sync round (sync.sync_once) every interval_s and after every verified
save, at most one copying round per publish_interval_s, a last round on stop."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from orchestrator.store.sync import SyncResult, sync_once

log = logging.getLogger(__name__)


def until_due(last_copy_at: float | None, publish_interval_s: float, now: float) -> float:
    """Seconds until the next round may copy: publishing starts at most every publish_interval_s."""
    return 0.0 if last_copy_at is None else max(0.0, last_copy_at + publish_interval_s - now)


class SyncThread(threading.Thread):
    """Runs sync_once every interval_s and on trigger(), but a round that copied holds the next one back
    until publish_interval_s after its start (then the newest is published, whatever was saved meanwhile);
    the final round is never held. Never raises, never blocks the caller."""

    def __init__(self, output_dir: str | os.PathLike, persistent_dir: str | os.PathLike, backend: str,
                 recipe_hash: str | None, interval_s: float = 300.0,
                 on_problem: Callable[[str], None] | None = None, final_lock_wait_s: float = 120.0,
                 publish_interval_s: float = 0.0, **sync_kwargs) -> None:
        super().__init__(name="orchestrator-sync", daemon=True)
        self.args = (output_dir, persistent_dir, backend, recipe_hash)
        self.interval_s, self.on_problem, self.sync_kwargs = interval_s, on_problem, sync_kwargs
        self.final_lock_wait_s, self.publish_interval_s = final_lock_wait_s, publish_interval_s
        self.last_copy_at: float | None = None  # monotonic start of the newest round that copied
        self.last_result: SyncResult | None = None
        self.last_success_at: float | None = None
        self.bytes_total = 0
        self.rounds = 0
        self._wake, self._stopping, self._cancel = threading.Event(), threading.Event(), threading.Event()
        self._final = False
        self._cond = threading.Condition()
        self._alerted: set[str] = set()

    def trigger(self) -> None:
        """Sync soon (call after a verified save)."""
        self._wake.set()

    def stop(self, timeout: float | None = None, final_sync: bool = False, cancel: bool = False) -> None:
        """Stop the thread; optionally run one last round first, or cancel a running copy."""
        self._final = final_sync
        if cancel:
            self._cancel.set()
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)

    def wait_rounds(self, n: int, timeout: float | None = None) -> bool:
        """Block until at least n rounds have finished."""
        with self._cond:
            return self._cond.wait_for(lambda: self.rounds >= n, timeout)

    def run(self) -> None:
        self._round()
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stopping.is_set():
                self._stopping.wait(until_due(self.last_copy_at, self.publish_interval_s, time.monotonic()))
            if self._stopping.is_set():
                if self._final:  # the last chance: wait for another sync (an orphaned rsync, --once) to finish
                    self._round(lock_wait_s=self.final_lock_wait_s)
                return
            self._round()

    def _round(self, lock_wait_s: float = 0.0) -> None:
        t0 = time.monotonic()
        try:
            r = sync_once(*self.args, cancel=self._cancel, lock_wait_s=lock_wait_s, **self.sync_kwargs)
        except Exception as e:  # noqa: BLE001 - the thread must survive anything
            r = SyncResult(problems=(f"sync crashed: {type(e).__name__}: {e}",))
        new = [p for p in r.problems if p not in self._alerted]
        self._alerted = set(r.problems)  # alert once per problem until it clears
        if self.on_problem is not None:
            for p in new:
                try:
                    self.on_problem(p)
                except Exception:
                    log.exception("on_problem hook failed")
        with self._cond:
            self.last_result = r
            self.bytes_total += r.bytes_copied
            if r.copied:
                self.last_copy_at = t0
            if r.synced:
                self.last_success_at = time.time()
            self.rounds += 1
            self._cond.notify_all()
