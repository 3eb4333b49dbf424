"""The supervisor: one loop, one state machine. Each handler does one state's work and returns the
next state; decisions come from pure functions (classify, policy). The machine (processes, GPUs,
ports, disk, the clock) is reached only through `self.host` (host/base.py), so every transition is
table-tested with an in-memory host (tests/test_state_machine.py); the run's own records go through
journal, checkpoints, sync, metrics and notify. The loop's state is the running attempt
(`self.attempt`: launch, watch, resume point, port, its crash and decision); the policy history is
rebuilt from the journal on start, so a restarted supervisor remembers crashes and NaN streaks.

    PREFLIGHT    checks, lock, predecessor's trainers stopped, resume point  -> VERIFYING
    VERIFYING    GPUs clear? else kill own leftovers (+ kill_patterns), force_wait_s, again;
                 still not clear -> stay here with backoff (never launch onto busy GPUs)
                                                                              -> LAUNCHING | RELAUNCHING
    (RE)LAUNCHING  render from the newest good checkpoint, start the process group  -> RUNNING
                 (that checkpoint is the last step's: -> COMPLETED, or VERIFYING for the export)
    RUNNING      gather -> detect (exit, hang, NaN, resume divergence, new checkpoints) -> act
                 hang: no new step within the attempt's timer (5 x its longest step gap once it has shown
                 its pace and a save, hang_floor_s..hang_timeout_s) and no save being written
                 exit 0 at max steps -> COMPLETED; failure -> CRASHED; stop/spot -> STOPPING
                 checkpoint.merge = "final": exit 0 at max steps -> VERIFYING, and the next launch is
                 the export of the newest verified checkpoint (an attempt of kind "export", watched by
                 this same loop; no step lines, so startup_timeout_s bounds it); its exit 0 with a
                 verified merged copy renamed into place -> COMPLETED; any failure -> CRASHED
    CRASHED      classify, decide (policy.decide)                            -> CLEANING | GAVE_UP
    CLEANING     SIGTERM group, grace, SIGKILL leftovers                      -> WAITING | BACKOFF
    WAITING/BACKOFF  wait_s (+ NCCL settle, + backoff), interruptible by stop; disk_full waits
                 for free space                                               -> VERIFYING
    STOPPING     SIGTERM the training, grace, final sync                     -> STOPPED
    COMPLETED, STOPPED -> exit 0;  GAVE_UP -> exit 3

PREFLIGHT, STOPPING and the shutdown are in lifecycle.py, the states between attempts (VERIFYING, CRASHED, CLEANING,
WAITING/BACKOFF) in recovery.py, the final export's in export_phase.py: the same object, split by concern.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import asdict, replace

from orchestrator.domain import classify, policy, verdict
from orchestrator.host import gpu
from orchestrator.host.base import Host
from orchestrator.host.gpu_gate import GpuGate
from orchestrator.host.probe import first_free_port
from orchestrator.host.journal import Journal
from orchestrator.host.launch.local import LaunchError
from orchestrator.host.metrics import Metrics
from orchestrator.host.notify import Heartbeat, Notifier
from orchestrator.store.published import PublishLock
from orchestrator.config.recipe import Recipe, RecipeError, recipe_hash
from orchestrator.config.render.command import render_command
from orchestrator.config.render.export import render_export
from orchestrator.domain.goodput import goodput_of
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.store.rundir import RunLock
from orchestrator.store.publisher import Publisher
from orchestrator.host.slurm_host import host_for
from orchestrator.host.spot import from_recipe as spot_notice
from orchestrator.types import TERMINAL_STATES, Attempt, Crash, CrashClass, ExitCode, Phase, State
from orchestrator.watch import AttemptWatch
from orchestrator.recovery import WAIT_SLICE_S, Recovery
from orchestrator.lifecycle import RunLifecycle
from orchestrator.export_phase import ExportPhase

CHECKPOINT_SCAN_S = 2.0
GOODPUT_EVERY_S = 10.0
ECHO_PROGRESS_S = 10.0


class Supervisor(RunLifecycle, Recovery, ExportPhase):
    def __init__(self, recipe: Recipe, *, host: Host | None = None, gpu_reader: gpu.GpuReader | None = None,
                 install_signals: bool = True, echo=None):
        """`host`: the machine (default: this one, GPUs through `gpu_reader` or NVML per the recipe);
        `echo`: a callable for one-line narration (events, progress) on the console."""
        self.recipe, self.echo = recipe, echo
        self.host: Host = host or host_for(recipe, gpu_reader or gpu.reader(recipe.gpu.check))
        self.hash = recipe_hash(recipe)
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.state = State.PREFLIGHT
        self.history = policy.History()         # rebuilt from the journal in pre-flight
        self.attempt: AttemptWatch | None = None  # the running (or last) attempt
        self.gpu_backoff_s = 0.0
        self.exit_reason = ""
        self.training_done: dict | None = None  # checkpoint.merge = "final": the export phase (journal kv too)
        self.metrics = Metrics(sync_enabled=recipe.run.persistent_dir is not None, clock=self.host.now,
                               max_crashes_per_hour=recipe.supervisor.max_crashes_per_hour)
        self.notifier = Notifier.from_env()
        self.heartbeat = Heartbeat(self.notifier, clock=self.host.monotonic)
        self.spot = spot_notice(recipe.supervisor)
        self.gpus = GpuGate(recipe, self.host, self.metrics)
        self.metrics_port: int | None = None
        self.echoed_at = self.goodput_at = self.last_scan = float("-inf")  # monotonic times of the last report
        self.journal: Journal | None = None   # set in preflight, with the lock, checkpoints and the sync sidecar
        self.checkpoints: CheckpointTracker | None = None
        self.sidecar: Publisher | None = None
        self.lock: RunLock | None = None
        self.publish_lock: PublishLock | None = None
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # USR1: Slurm's --signal ahead of the time limit
                signal.signal(sig, lambda s, _f: self.request_stop(f"signal {signal.Signals(s).name}"))

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> ExitCode:
        try:
            while self.state not in TERMINAL_STATES:
                self.step()
        finally:
            self._shutdown()
        return ExitCode.GAVE_UP if self.state is State.GAVE_UP else ExitCode.OK

    def step(self) -> State:
        """One state's work: run its handler, enter the state it returns (the table tests call this)."""
        handler = {
            State.PREFLIGHT: self._preflight, State.VERIFYING: self._verify_gpus,
            State.LAUNCHING: self._launch, State.RELAUNCHING: self._launch, State.RUNNING: self._watch,
            State.CRASHED: self._decide, State.CLEANING: self._clean, State.WAITING: self._wait,
            State.BACKOFF: self._wait, State.STOPPING: self._stop,
        }[self.state]
        self._enter(handler())
        return self.state

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop_event.set()

    def _enter(self, state: State) -> None:
        if state is not self.state:
            self.journal.event("state", f"{self.state.value} -> {state.value}")
        self.state = state
        self.metrics.set_state(state)
        step = self.attempt.last.step if self.attempt and self.attempt.last else None
        self.journal.put(state=state.value, updated_at=self.host.now(), attempt=self.attempt.n if self.attempt else 0,
                         **({"step": step} if step is not None else {}))  # keep the last step across a relaunch
        self.notifier.status(f"{state.value}" + (f" step {step}" if step is not None else ""))

    def _pass_done(self) -> None:
        now, mono = self.host.now(), self.host.monotonic()
        self.heartbeat.ping_if_due(mono)
        self.metrics.tick(now)
        if self.journal.held and self.journal.flush():
            self.journal.event("disk_full", "journal writes held while the disk was full are recorded now")
        self.sidecar.report()
        if mono - self.goodput_at >= GOODPUT_EVERY_S:
            self.goodput_at = mono
            a = self.attempt
            if a and a.first_step_at and a.row.ended_at is None:  # live progress of the running attempt
                self._record(replace(a.row, first_step_at=a.first_step_at, last_step_at=a.last_step_at,
                                     end_step=a.last.step))
            g = goodput_of(self.journal, now)
            self.metrics.goodput(g.ratio, g.lost)
        reason = self.spot.check(now)
        if reason:
            self.request_stop(f"spot interruption: {reason}")

    # --- states -------------------------------------------------------------------------------
    def _launch(self) -> State:
        r, before = self.recipe, self.attempt
        resume = self.checkpoints.resume_point()
        export = self._export_phase()
        if not export and (done := self._trained_to_the_end(resume, before)):
            return done
        if export and resume is None:
            self.exit_reason = "training finished but no verified checkpoint is left to export"
            self.journal.event("export", self.exit_reason)
            return State.GAVE_UP
        if export:  # a supervisor restarted after the rename, before recording COMPLETED
            final, problems = self.checkpoints.place_merged(resume.path)
            if final.is_dir() and not problems:
                self.journal.event("merged", f"{final.name} is verified: the run is complete")
                return State.COMPLETED
        elif resume is None and self.sidecar.enabled:  # a new machine: the newest published copy, if any
            started = self.host.now()
            resume = self._restore()
            self.journal.span(started, self.host.now(), "restore")
            if self.stop_event.is_set():
                return State.STOPPED
        now = self.host.now()
        lo, hi = r.supervisor.port_range
        port = before.port if before else None
        if port is None or (before.decision and before.decision.new_port) or not self.host.port_free(port):
            port = first_free_port(lo, hi, avoid={port} if port else set(), is_free=self.host.port_free)
        if port is None:
            self.journal.event("port", f"no free rendezvous port in {lo}-{hi}; retrying")
            self._sleep(r.supervisor.wait_s)
            return State.VERIFYING
        n = (before.n if before else self.attempts_before) + 1  # in memory: a full disk may hold the journal's rows
        if export:
            save_steps, measured = None, None
            cmd = render_export(r, resume.path, str(self.checkpoints.export_staging(resume.path)), port)
        else:
            save_steps, measured = self.intervals.choose(n, now), self.intervals.reporter(n)
            cmd = render_command(r, resume, port, save_steps)
        log = self.state_dir / "attempts" / f"attempt-{n:04d}.log"
        # The row first: a supervisor killed right after the launch leaves a row its successor closes.
        row = Attempt(n, now, port=port, resumed_from=resume.path if resume else None, log_path=str(log),
                      start_step=resume.step if resume else 0, kind="export" if export else "train")
        self.journal.record_attempt(row)
        try:
            launched = self.host.launch(cmd, log, self.run_id, cwd=str(self.out))
        except LaunchError as e:  # the executable vanished after pre-flight: bad input, not a crash to retry
            self.journal.record_attempt(replace(row, ended_at=self.host.now(), evidence=(str(e),)))
            self.journal.event("launch_failed", str(e))
            raise RecipeError(str(e)) from e
        self.attempt = AttemptWatch.start(n, launched, port, resume, self.out,
                                          replace(row, pid=launched.pid, pid_start_time=launched.create_time),
                                          save_steps, measured)
        self.journal.record_attempt(self.attempt.row)
        self.host.evidence_baseline(launched, self.run_id, self.gpus.run_gpus() if r.gpu.check else [])
        self.checkpoints.forget_after(self.attempt.good_step_at_launch)
        self.journal.event("launch", f"attempt {n} pid {launched.pid} port {port}"
                           + (f" exporting the merged model of {resume.path}" if export else
                              f" resuming from {resume.path}" if resume else " fresh"), argv=list(cmd.argv))
        if n > 1 and not (export and before and before.row.kind == "train"):  # the export is no restart
            self.metrics.restart()
        return State.RUNNING

    def _watch(self) -> State:
        a, s = self.attempt, self.recipe.supervisor
        self.host.wait_exit(a.launched, s.poll_s)  # wakes at once on exit
        now, mono = self.host.now(), self.host.monotonic()
        for p in a.gather(now, mono):
            self.metrics.observe_progress(p)
        if self.echo and a.last and mono - self.echoed_at >= ECHO_PROGRESS_S:
            self.echoed_at = mono
            loss = f" loss {a.last.loss:.4g}" if a.last.loss is not None else ""
            self.echo(f"{time.strftime('%H:%M:%S', time.localtime(now))} progress: step {a.last.step}/{a.last.max_steps}{loss}")
        full = self._keep_space() if self._scan_checkpoints() else None
        self._pass_done()
        exited = a.launched.status is not None
        if exited:
            self._drain(a)  # everything it wrote before exiting, however much
        if a.bad:  # also when the trainer exited after the NaN (a crash, or max steps) before this pass
            self.journal.put(nan_pending={"attempt": a.n, "step": a.bad_step})  # survives a kill before _clean
            return self._crashed(Crash(CrashClass.NAN_LOSS, a.bad, Phase.TRAINING))
        if exited and a.row.kind == "export":
            return self._export_finished(a)
        if exited and a.done and a.launched.status.code != 0 and a.last and self.checkpoints.verified_at(a.last.step):
            # every step done and the last save verified: a failure while tearing down (seen: a gloo rank's
            # "terminate called without an active exception" at exit) leaves nothing to redo
            st = a.launched.status
            self.journal.event("teardown_failure", f"the trainer exited {st.code if st.code is not None else f'by signal {st.signal}'} "
                               f"after its last step {a.last.step}, whose checkpoint verified: training is complete")
            return self._training_finished(a)
        if exited and a.done and a.launched.status.code == 0:
            torn = self.checkpoints.failed_at(a.last.step) if a.last else ()
            if torn:  # not complete: the newest verified checkpoint is older than the last step
                return self._crashed(Crash(CrashClass.OTHER, (
                    f"the trainer exited 0 at step {a.last.step} but its final checkpoint failed verification: "
                    "not complete; find why the save broke, then rerun to redo the steps after the newest "
                    "verified checkpoint",) + torn, Phase.TRAINING))
            return self._training_finished(a)
        if exited:
            return self._crashed(None)
        if self.stop_event.is_set():
            return State.STOPPING
        if full:
            return self._crashed(Crash(CrashClass.DISK_FULL, (full,), self._phase()))
        divergence = self._resume_divergence()
        if divergence:
            self.metrics.resume_divergence()
            self.journal.event("resume_divergence", divergence)
            self.exit_reason = f"resume divergence: {divergence}"
            self.host.terminate(self.run_id, {a.launched.pid}, s.grace_s)
            return State.GAVE_UP
        hang = self._hang(now, mono)
        if hang:
            a.hang_at = now
            self.host.dump_stacks(a.launched.pid, self.state_dir / f"stacks-{a.n:04d}.txt")
            return self._crashed(Crash(CrashClass.NCCL_TIMEOUT_HANG, (hang,), self._phase()))
        return State.RUNNING

    def _crashed(self, found: Crash | None) -> State:
        """`found`: what the supervisor itself saw (hang, NaN); otherwise classify the log. Then what the machine
        says (verdict.combine): a disk full at the crash, a GPU fault, a kernel OOM kill outrank the log."""
        a, r = self.attempt, self.recipe
        if found is None:
            text, node = self.host.failure_log(a.launched)  # multi-node: the node srun saw fail first
            if node:
                a.row = replace(a.row, node=node)
            found = classify.classify(text, a.launched.status, self._phase())
            if a.launched.status.code == 0 and found.cls is CrashClass.OTHER:
                last = a.last.step if a.last else None
                found = Crash(CrashClass.OTHER, (f"trainer exited 0 at step {last} before max steps",) + found.evidence,
                              found.phase)
        paths = {"output_dir": r.run.output_dir, "/dev/shm": "/dev/shm"} | (
            {"persistent_dir": r.run.persistent_dir} if r.run.persistent_dir else {})
        system = self.host.evidence(a.launched, paths, a.port if found.cls is CrashClass.PORT_IN_USE else None)
        crash = verdict.combine(found, a.launched.status, system, min(r.supervisor.min_free_gib, 1.0))
        if facts := crash.evidence[:len(crash.evidence) - len(found.evidence)]:
            self.journal.event("evidence", f"attempt {a.n}: " + "; ".join(facts))
        a.row = replace(a.row, system=asdict(system))  # kept by _finish_attempt's record
        a.crash = crash
        return State.CRASHED

    # --- helpers ------------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> bool:
        """A deliberate wait: interruptible by a stop, and the loop keeps reporting (watchdog, spot).
        Returns True when a stop cut it short."""
        deadline = self.host.monotonic() + max(0.0, seconds)
        while not self.stop_event.is_set():
            remaining = deadline - self.host.monotonic()
            if remaining <= 0:
                return False
            if self.host.wait(self.stop_event, min(WAIT_SLICE_S, remaining)):
                break
            self._pass_done()
        return True

    def _hang(self, now: float, mono: float) -> str | None:
        """No new step within the attempt's hang timer (policy.hang_timeout), and no save in progress: at 397B a
        merged copy takes half an hour to write, and no step is logged meanwhile."""
        a, s = self.attempt, self.recipe.supervisor
        timer, why = policy.hang_timeout(s, a.longest_gap_s, a.gaps, len(a.saves),
                                         evals_apart="eval_steps" in self.recipe.extra_args)
        if timer != a.hang_timer_s:
            if a.hang_timer_s is None or a.hang_timer_s >= s.hang_timeout_s > timer:
                self.journal.event("hang_timer", f"attempt {a.n}: hang timer {timer:.0f} s: {why}", seconds=timer)
            a.hang_timer_s = timer
            self.metrics.hang_timer(timer)
        hang = policy.hang_verdict(mono, a.launched.started_mono, a.last_step_mono, timer, s.startup_timeout_s)
        if hang and a.row.kind == "export":
            return (f"the export still runs after startup_timeout_s = {s.startup_timeout_s:.0f} s (an export logs "
                    f"no steps: startup_timeout_s bounds it; raise it for a model this size)")
        last = self.host.newest_write(self.out) if hang else None
        if not hang or (last is not None and now - last < timer):
            return None
        return hang if a.last_step_mono is None else f"{hang}: {why}"

    def _drain(self, a: AttemptWatch) -> None:
        """Read everything an exited trainer wrote (log, logging.jsonl, checkpoints) before recording it."""
        for p in a.gather(self.host.now(), self.host.monotonic(), drain=True):
            self.metrics.observe_progress(p)
        self._scan_checkpoints(force=True)

    def _quarantine(self, nan_step: int, attempt_n: int) -> None:
        """Local copies first (no round can republish one), then the published; nan_pending cleared after both."""
        self.checkpoints.quarantine(nan_step, attempt_n)
        self.sidecar.quarantine(nan_step, attempt_n)
        self.journal.put(nan_pending=None)

    def _launch_state(self) -> State:
        return State.RELAUNCHING if self.attempt else State.LAUNCHING

    def _phase(self) -> Phase:
        return Phase.TRAINING if self.attempt and self.attempt.first_step is not None else Phase.STARTUP

    def _scan_checkpoints(self, force: bool = False) -> bool:
        mono = self.host.monotonic()
        if not force and mono - self.last_scan < CHECKPOINT_SCAN_S:
            return False
        self.last_scan = mono
        self.checkpoints.scan(self.host.now())
        self.checkpoints.retry_manifests()
        return True

    def _keep_space(self) -> str | None:
        """Local retention, and under disk pressure (less free than the next save needs) pruning down to the
        resume point and what is not yet published. Returns why the trainer must stop when even that
        leaves less than min(next save, min_free_gib): it would meet ENOSPC mid-save."""
        out, min_free = self.recipe.run.output_dir, self.recipe.supervisor.min_free_gib
        need = self.save_gib or min_free
        free = self.host.free_gib(out)
        if self.checkpoints.prune(self.keep_local, pressure=free < need, trusted_through=self.attempt.clean_through):
            free = self.host.free_gib(out)
        if free < min(need, min_free):
            return (f"{out}: {free:.3g} GiB free, the next save needs ~{need:.3g} GiB and nothing more can be "
                    "pruned: stopped before the trainer meets ENOSPC")
        return None

    def _resume_divergence(self) -> str | None:
        a = self.attempt
        if a.resume is None or a.first_logged is None or a.resume_checked:
            return None
        a.resume_checked = True
        p = a.first_logged
        return policy.resume_verdict(a.resume.step, p.step, p.loss, a.prior_losses.get(p.step),
                                     self.recipe.checkpoint.logging_steps, self.recipe.checkpoint.resume_loss_tolerance)

    def _record(self, row: Attempt) -> None:
        self.attempt.row = row
        self.journal.record_attempt(row)

    def _finish_attempt(self, crash: Crash, stopped: bool = False) -> None:
        a = self.attempt
        self.host.wait_exit(a.launched, 10)  # the reaper records the exit status right after terminate()
        st = a.launched.status
        self._record(replace(a.row, ended_at=self.host.now(), exit_code=st.code if st else None,
                             signal=st.signal if st else None, cls=None if stopped else crash.cls,
                             evidence=crash.evidence, end_step=a.last.step if a.last else None,
                             first_step_at=a.first_step_at, last_step_at=a.last_step_at,
                             hang_detected_at=a.hang_at))

