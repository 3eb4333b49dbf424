"""The supervisor's states between two attempts, split out of supervisor.py by concern (the same object:
Supervisor inherits them; its step() table names every state on one screen):

    VERIFYING        GPUs clear? else own leftovers (+ kill_patterns) stopped, force_wait_s, again; a node
                     that stays bad is excluded (Slurm); still not clear -> stay with backoff
    CRASHED          policy.decide on the classified crash                    -> CLEANING
    CLEANING         SIGTERM the group, grace, SIGKILL leftovers              -> WAITING | BACKOFF | GAVE_UP
    WAITING/BACKOFF  verified-ready (processes, GPU memory, NCCL segments, a port; wait_s the bound) or the
                     fixed wait; disk_full waits for space                    -> VERIFYING
    (LAUNCHING)      nothing local to resume from: the newest published copy restored in the background
                     (_restore); a NaN quarantines the copies written at or after it (_quarantine)
"""
from __future__ import annotations

from orchestrator.domain import policy
from orchestrator.host import pagecache
from orchestrator.host.probe import first_free_port
from orchestrator.types import Action, Alert, CrashClass, Resume, State

GIB = 1024**3
WAIT_SLICE_S = 1.0
RESTORE_REPORT_S = 30.0   # a deliberate wait reports (watchdog, spot notice, sync) at least this often


class Recovery:
    def _verify_gpus(self) -> State:
        if self.stop_event.is_set():
            return State.STOPPED
        if self.gpus.exclude_stuck_node(self.journal):  # multi-node: the job was requeued without a bad node
            self.request_stop("a bad node was excluded and the Slurm job requeued")
            return State.STOPPED
        if not self.recipe.gpu.check:
            return self._launch_state()
        started = self.host.now()
        snap = self.host.gpu_snapshot()
        clear, problems = self.gpus.verdict(snap)
        if not clear:
            self.gpus.clear(snap, problems, self.run_id, self.journal)
            self._sleep(self.recipe.supervisor.force_wait_s)
            clear, problems = self.gpus.verdict(self.host.gpu_snapshot())
        self.journal.span(started, self.host.now(), "verify")
        if clear:
            self.gpu_backoff_s = 0.0
            return self._launch_state()
        s = self.recipe.supervisor
        self.gpu_backoff_s = min(s.backoff_max_s, max(self.gpu_backoff_s * 2, s.force_wait_s, 1.0))
        self.journal.event("gpus_not_clear", "; ".join(problems), retry_in_s=self.gpu_backoff_s)
        self._sleep(self.gpu_backoff_s)
        return State.VERIFYING

    def _decide(self) -> State:
        a, now = self.attempt, self.host.now()
        progressed = self.checkpoints.newest_good_step() > a.good_step_at_launch
        a.decision = policy.decide(a.crash, self.history, self.recipe.supervisor, now, progressed)
        self.history = policy.next_history(self.history, a.crash, now, progressed)
        self.metrics.crash(a.crash.cls)
        self.journal.event("crash", f"attempt {a.n}: {a.crash.cls.value} -> {a.decision.action.value}:"
                           f" {a.decision.reason}", evidence=list(a.crash.evidence))
        if a.decision.alert:
            self.metrics.alert(a.decision.alert, True)
        return State.CLEANING

    def _clean(self) -> State:
        a, started = self.attempt, self.host.now()
        killed = self.host.terminate(self.run_id, {a.launched.pid}, self.recipe.supervisor.grace_s)
        if killed:
            self.journal.event("cleanup", f"SIGKILLed {len(killed)} process(es) that ignored SIGTERM", pids=killed)
        self._finish_attempt(a.crash)
        if a.crash.cls is CrashClass.NAN_LOSS and a.bad_step is not None:
            self._quarantine(a.bad_step, a.n)
        self.journal.span(started, self.host.now(), "cleanup")
        if a.decision.action is Action.GIVE_UP:
            self.exit_reason = a.decision.reason
            return State.GAVE_UP
        return State.BACKOFF if a.decision.backoff_s else State.WAITING

    def _wait(self) -> State:
        """`supervisor.wait = "verified"`: relaunch as soon as the run's processes, GPU memory, NCCL
        segments and a port are clear (wait_s the upper bound, nccl_settle_s the floor after nccl_*);
        "fixed": wait_s, the field's blind wait. A crash-loop backoff is always waited in full.
        The weight files are read into the page cache meanwhile."""
        a, s, started = self.attempt, self.recipe.supervisor, self.host.now()
        d, mono = a.decision, self.host.monotonic()
        verified = s.wait == "verified" and d.action is Action.RELAUNCH
        self.host.warm_page_cache(pagecache.weight_files(self.recipe.model.path))
        if self._sleep(d.backoff_s if verified else d.wait_s + d.backoff_s):
            return State.STOPPED
        waited_for: tuple[str, ...] = ()
        if verified:
            ready = self._await_ready(policy.settle_floor(a.crash.cls, s), d.wait_s)
            if ready is None:
                return State.STOPPED
            waited_for = ready.waiting_for
        if d.action is Action.WAIT_FOR_SPACE:
            self.checkpoints.retry_manifests()  # a full disk refused them; unpublished copies wait for them
            self.checkpoints.prune(self.keep_local, pressure=True, writing=False)  # torn saves, what was published
            free, need = self.host.free_gib(self.recipe.run.output_dir), self.recipe.supervisor.min_free_gib
            if free < need:
                self.journal.event("disk_full", f"{self.recipe.run.output_dir}: {free:.1f} GiB free, waiting for {need:g}")
                self._pass_done()
                return State.WAITING
            self.metrics.alert(Alert.DISK_FULL, False)
        self.journal.span(started, self.host.now(), "backoff" if d.backoff_s else "wait")
        took = self.host.monotonic() - mono
        self.journal.event("wait", f"{'verified' if verified else 'fixed'} wait {took:.2f} s"
                           + (f" (upper bound reached; still: {'; '.join(waited_for)})" if waited_for else ""),
                           mode="verified" if verified else "fixed", seconds=round(took, 3),
                           bound_s=d.wait_s, backoff_s=d.backoff_s, not_clear=list(waited_for))
        self._pass_done()
        return State.VERIFYING

    def _await_ready(self, floor_s: float, bound_s: float) -> policy.Readiness | None:
        """Poll the host until policy.readiness_verdict says go; None when a stop cut it short."""
        begun, lo, hi = self.host.monotonic(), *self.recipe.supervisor.port_range
        while True:
            shm = self.host.shm_segments(self.run_id)
            orphans = sorted(n for n, pids in shm.items() if not pids)
            if orphans:  # left by a SIGKILLed rank: no wait frees them, nobody maps them
                self.host.remove_shm(orphans)
                self.journal.event("cleanup", f"removed {len(orphans)} NCCL shm segment(s) nobody maps", names=orphans)
            gpu_problems = self.gpus.verdict(self.host.gpu_snapshot())[1] if self.recipe.gpu.check else []
            ready = policy.readiness_verdict(
                self.host.monotonic() - begun, floor_s, bound_s, self.host.leftovers(self.run_id), gpu_problems,
                {n: pids for n, pids in shm.items() if pids},
                first_free_port(lo, hi, is_free=self.host.port_free) is not None)
            if ready.go:
                return ready
            if self._sleep(ready.recheck_s):
                return None

    def _restore(self) -> Resume | None:
        """The restore runs in the background; the loop waits in slices that keep the watchdog and the
        status alive, and reports progress (a 397B checkpoint is hundreds of GB: minutes, not seconds)."""
        started = reported = self.host.monotonic()
        self.sidecar.start_restore()
        while not self.sidecar.restore_done.is_set():
            if self._sleep(WAIT_SLICE_S):
                break
            mono = self.host.monotonic()
            copied = self.sidecar.restore_copied_bytes()
            self.journal.put(restore_copied_bytes=copied)
            if mono - reported >= RESTORE_REPORT_S:
                reported = mono
                self.journal.event("restore_progress", f"{copied / GIB:.1f} GiB copied in {mono - started:.0f} s")
                self.notifier.status(f"restoring: {copied / GIB:.1f} GiB copied")
        best = self.sidecar.finish_restore()
        return self.checkpoints.resume_from(best) if best else None
