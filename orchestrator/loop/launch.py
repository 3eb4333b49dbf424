"""LAUNCHING / RELAUNCHING: the newest verified checkpoint (restored from persistent storage in the background on
a new machine), the save interval, a free port, the rendered command, the attempt's journal row first, then the
trainer in its own process group.

    the last step's checkpoint                     -> COMPLETED, or VERIFYING for the export (nothing relaunched)
    the export phase and no checkpoint to export   -> GAVE_UP
    no free rendezvous port                        -> VERIFYING (after wait_s)
    a stop while restoring                         -> STOPPED
    launched                                       -> RUNNING
"""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import replace

from orchestrator.config.recipe import RecipeError
from orchestrator.config.render.command import render_command
from orchestrator.config.render.export import render_export
from orchestrator.domain.health.skipped_steps import fp16_run
from orchestrator.host.base import Host
from orchestrator.host.launch.local import LaunchError
from orchestrator.host.metrics import Metrics
from orchestrator.host.notify import Notifier
from orchestrator.host.probe import first_free_port
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.export import ExportPhase
from orchestrator.loop.gpu_gate import GpuGate
from orchestrator.loop.run import RunContext
from orchestrator.loop.ticker import WAIT_SLICE_S, Ticker
from orchestrator.types import GIB, Attempt, AttemptKind, Resume, State

RESTORE_REPORT_S = 30.0   # a deliberate wait reports (watchdog, spot notice, sync) at least this often
# Before a launch, how long the resume candidate's manifest and content check are awaited: hashing runs at
# about 1 GiB/s (bench/), so a 397B save with optimizer state is minutes; past this the launch resumes from the
# newest healthy checkpoint instead of waiting on.
CONTENT_CHECK_WAIT_S = 900.0


class Launcher:
    def __init__(self, ctx: RunContext, host: Host, gpus: GpuGate, metrics: Metrics, notifier: Notifier,
                 ticker: Ticker, export: ExportPhase, stop_event: threading.Event):
        self.ctx, self.recipe, self.host, self.gpus, self.metrics = ctx, ctx.recipe, host, gpus, metrics
        self.notifier, self.ticker, self.export, self.stop_event = notifier, ticker, export, stop_event
        self.journal, self.checkpoints = ctx.journal, ctx.checkpoints
        self.exit_reason = ""  # why a launch gave up

    def launch(self, before: AttemptWatch | None) -> tuple[State, AttemptWatch | None]:
        """Starts the next attempt after `before` (None: the first of this supervisor); returns the next state
        and the attempt launched (None when nothing was)."""
        r, ctx = self.recipe, self.ctx
        if (unsettled := self.settle()) is not None:
            return unsettled, None
        resume = self.checkpoints.resume_point()
        exporting = self.export.exporting()
        if not exporting and (over := self.export.nothing_left_to_train(resume, before)):
            return over, None
        if exporting and resume is None:
            self.exit_reason = "training finished but no verified checkpoint is left to export"
            self.journal.event("export", self.exit_reason)
            return State.GAVE_UP, None
        if exporting:  # a supervisor restarted after the rename, before recording COMPLETED
            assert resume is not None
            final, problems = self.checkpoints.place_merged(resume.path)
            if final.is_dir() and not problems:
                self.journal.event("merged", f"{final.name} is verified: the run is complete")
                return State.COMPLETED, None
        elif resume is None and ctx.publisher.enabled:  # a new machine: the newest published copy, if any
            with self.ticker.span("restore"):
                resume = self._restore()
            if self.stop_event.is_set():
                return State.STOPPED, None
            if resume is not None:  # a restored copy is checked like a local save before it is trusted
                if (unsettled := self.settle()) is not None:
                    return unsettled, None
                resume = self.checkpoints.resume_point()
        now = self.host.now()
        lo, hi = r.supervisor.port_range
        port = before.port if before else None
        if port is None or (before and before.decision and before.decision.new_port) or not self.host.port_free(port):
            port = first_free_port(lo, hi, avoid={port} if port else set(), is_free=self.host.port_free)
        if port is None:
            self.journal.event("port", f"no free rendezvous port in {lo}-{hi}; retrying")
            with self.ticker.span("wait"):
                self.ticker.sleep(r.supervisor.wait_s)
            return State.VERIFYING, None
        n = (before.n if before else ctx.attempts_before) + 1  # in memory: a full disk may hold the journal's rows
        if exporting:
            assert resume is not None
            save_steps, measured = None, None
            cmd = render_export(r, resume.path, str(self.checkpoints.export_staging(resume.path)), port)
        else:
            save_steps, measured = ctx.intervals.choose(n, now), ctx.intervals.reporter(n)
            cmd = render_command(r, resume, port, save_steps)
        log = ctx.state_dir / "attempts" / f"attempt-{n:04d}.log"
        kind = AttemptKind.EXPORT if exporting else AttemptKind.TRAIN
        # The row first: a supervisor killed right after the launch leaves a row its successor closes.
        row = Attempt(n, now, port=port, resumed_from=resume.path if resume else None, log_path=str(log),
                      start_step=resume.step if resume else 0, kind=kind)
        self.journal.record_attempt(row)
        try:
            launched = self.host.launch(cmd, log, ctx.run_id, cwd=str(ctx.out))
        except LaunchError as e:  # the executable vanished after pre-flight: bad input, not a crash to retry
            self.journal.record_attempt(replace(row, ended_at=self.host.now(), evidence=(str(e),)))
            self.journal.event("launch_failed", str(e))
            raise RecipeError(str(e)) from e
        attempt = AttemptWatch.start(n, launched, port, resume, ctx.out,
                                     replace(row, pid=launched.pid, pid_start_time=launched.create_time),
                                     save_steps, measured, fp16_run(r), r.health.max_skipped_steps)
        self.journal.record_attempt(attempt.row)
        self.host.evidence_baseline(launched, ctx.run_id, self.gpus.run_gpus() if r.gpu.check else [])
        self.checkpoints.forget_after(attempt.good_step_at_launch)
        self.journal.event("launch", f"attempt {n} pid {launched.pid} port {port}"
                           + (f" exporting the merged model of {resume.path}" if exporting and resume else
                              f" resuming from {resume.path}" if resume else " fresh"), argv=list(cmd.argv))
        if n > 1 and not (exporting and before and before.row.kind == AttemptKind.TRAIN):  # the export is no restart
            self.metrics.restart()
        return State.RUNNING, attempt

    def settle(self) -> State | None:
        """Completes the resume candidate's standing before a launch: new checkpoints verified, their content
        checks awaited for at most CONTENT_CHECK_WAIT_S (a `verify` span) and what they found applied, pending
        set-asides moved (no trainer runs now). A check still running then leaves its checkpoint out of this
        resume. Returns STOPPED when a stop cut the wait short, VERIFYING when a checkpoint to set aside could not
        be moved yet (the relaunch would write into its directory), None when the launch may go on."""
        ckpts, st = self.checkpoints, self.ctx.standings
        ckpts.scan(self.host.now())

        def open_work() -> tuple[list, bool]:
            ckpts.apply_checks()
            self.ctx.apply_set_asides()
            return ckpts.pending_checks(), any(not p.local_done for p in st.pending)

        checks, unmoved = open_work()
        if not checks and not unmoved:
            return None
        deadline = self.host.monotonic() + CONTENT_CHECK_WAIT_S
        with self.ticker.span("verify"):
            while checks or unmoved:
                if self.host.monotonic() >= deadline:
                    if unmoved:
                        self.journal.event("quarantine", "checkpoints to set aside could not be moved yet (a copy "
                                           "in flight?): not launching into their directories; retrying")
                        return State.VERIFYING
                    self.journal.event("resume_skip", f"content checks still running after {CONTENT_CHECK_WAIT_S:.0f}"
                                       " s: resuming from the newest healthy checkpoint", pending=len(checks))
                    return None
                if checks:
                    futures.wait(checks, timeout=WAIT_SLICE_S)
                if (unmoved or any(not f.done() for f in checks)) and self.ticker.sleep(WAIT_SLICE_S):
                    return State.STOPPED
                checks, unmoved = open_work()
        return None

    def _restore(self) -> Resume | None:
        """Restores the newest published checkpoint in the background; the loop waits in slices that keep the
        watchdog and the status alive, and reports progress (a 397B checkpoint is hundreds of GB: minutes)."""
        publisher = self.ctx.publisher
        started = reported = self.host.monotonic()
        publisher.start_restore()
        while not publisher.restore_done.is_set():
            if self.ticker.sleep(WAIT_SLICE_S):
                break
            mono = self.host.monotonic()
            copied = publisher.restore_copied_bytes()
            self.journal.put(restore_copied_bytes=copied)
            if mono - reported >= RESTORE_REPORT_S:
                reported = mono
                self.journal.event("restore_progress", f"{copied / GIB:.1f} GiB copied in {mono - started:.0f} s")
                self.notifier.status(f"restoring: {copied / GIB:.1f} GiB copied")
        best = publisher.finish_restore()
        return self.checkpoints.resume_from(best) if best else None
