"""The supervisor: one loop, one state machine. Each handler does one state's work and returns the
next state; decisions come from pure functions (classify, policy), side effects from launcher,
gpu, checkpoints, sync, journal, metrics and notify.

    PREFLIGHT    checks, lock, predecessor's trainers stopped, resume point  -> VERIFYING
    VERIFYING    GPUs clear? else kill own leftovers (+ kill_patterns), force_wait_s, again;
                 still not clear -> stay here with backoff (never launch onto busy GPUs)
                                                                              -> LAUNCHING | RELAUNCHING
    (RE)LAUNCHING  render from the newest good checkpoint, start the process group  -> RUNNING
    RUNNING      gather -> detect (exit, hang, NaN, resume divergence, new checkpoints) -> act
                 exit 0 at max steps -> COMPLETED; failure -> CRASHED; stop/spot -> STOPPING
    CRASHED      classify, decide (policy.decide)                            -> CLEANING | GAVE_UP
    CLEANING     SIGTERM group, grace, SIGKILL leftovers                      -> WAITING | BACKOFF
    WAITING/BACKOFF  wait_s (+ NCCL settle, + backoff), interruptible by stop; disk_full waits
                 for free space                                               -> VERIFYING
    STOPPING     SIGTERM the training, grace, final sync                     -> STOPPED
    COMPLETED, STOPPED -> exit 0;  GAVE_UP -> exit 3
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

from orchestrator import classify, gpu, launcher, plan, policy
from orchestrator.journal import Journal, journal_path
from orchestrator.metrics import Metrics
from orchestrator.notify import Heartbeat, Notifier
from orchestrator.published import PublishLock
from orchestrator.recipe import Recipe, RecipeError, recipe_hash, semantic_view
from orchestrator.render.command import render_command
from orchestrator.report import goodput_of
from orchestrator.run_checkpoints import RunCheckpoints
from orchestrator.rundir import RunLock, place, run_id, state_dir
from orchestrator.sidecar import Sidecar
from orchestrator.spot import from_recipe as spot_notice
from orchestrator.types import TERMINAL_STATES, Action, Attempt, Crash, CrashClass, Decision, ExitCode, Phase, State
from orchestrator.watch import AttemptWatch

CHECKPOINT_SCAN_S = 2.0
GOODPUT_EVERY_S = 10.0
ECHO_PROGRESS_S = 10.0


class Supervisor:
    def __init__(self, recipe: Recipe, *, gpu_reader: gpu.GpuReader | None = None, clock=time.time,
                 install_signals: bool = True, echo=None):
        """`echo`: a callable for one-line narration (events, progress) on the console."""
        self.recipe, self.clock, self.echo = recipe, clock, echo
        self.echoed_at = 0.0
        self.hash = recipe_hash(recipe)
        self.gpus = gpu_reader or gpu.reader(recipe.gpu.check)
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.state = State.PREFLIGHT
        self.history = policy.History()
        self.attempt: AttemptWatch | None = None
        self.attempts = 0
        self.decision: Decision | None = None
        self.crash: Crash | None = None
        self.port: int | None = None
        self.good_step_at_launch = -1
        self.gpu_backoff_s = 0.0
        self.exit_reason = ""
        self.metrics = Metrics(sync_enabled=recipe.run.persistent_dir is not None)
        self.notifier = Notifier.from_env()
        self.heartbeat = Heartbeat(self.notifier)
        self.spot = spot_notice(recipe.supervisor)
        self.hang_at: float | None = None
        self.goodput_at = 0.0
        self.metrics_port: int | None = None
        self.last_scan = 0.0
        self.journal: Journal | None = None   # set in preflight, with the lock, checkpoints and the sync sidecar
        self.checkpoints: RunCheckpoints | None = None
        self.sidecar: Sidecar | None = None
        self.lock: RunLock | None = None
        self.publish_lock: PublishLock | None = None
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda s, _f: self.request_stop(f"signal {signal.Signals(s).name}"))

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> ExitCode:
        handlers = {
            State.PREFLIGHT: self._preflight, State.VERIFYING: self._verify_gpus,
            State.LAUNCHING: self._launch, State.RELAUNCHING: self._launch, State.RUNNING: self._watch,
            State.CRASHED: self._decide, State.CLEANING: self._clean, State.WAITING: self._wait,
            State.BACKOFF: self._wait, State.STOPPING: self._stop,
        }
        try:
            while self.state not in TERMINAL_STATES:
                self._enter(handlers[self.state]())
        finally:
            self._shutdown()
        return ExitCode.GAVE_UP if self.state is State.GAVE_UP else ExitCode.OK

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop_event.set()

    def _enter(self, state: State) -> None:
        if state is not self.state:
            self.journal.event("state", f"{self.state.value} -> {state.value}")
        self.state = state
        self.metrics.set_state(state)
        step = self.attempt.last.step if self.attempt and self.attempt.last else None
        self.journal.put(state=state.value, updated_at=self.clock(), attempt=self.attempts,
                         **({"step": step} if step is not None else {}))  # keep the last step across a relaunch
        self.notifier.status(f"{state.value}" + (f" step {step}" if step is not None else ""))

    def _pass_done(self) -> None:
        now = self.clock()
        self.heartbeat.ping_if_due(now)
        self.metrics.tick(now)
        self.sidecar.report()
        if now - self.goodput_at >= GOODPUT_EVERY_S:
            self.goodput_at = now
            a = self.attempt
            if a and a.first_step_at and a.n == self._current.n and self._current.ended_at is None:  # live progress
                self._record(replace(self._current, first_step_at=a.first_step_at, last_step_at=a.last_step_at,
                                     end_step=a.last.step))
            g = goodput_of(self.journal, now)
            self.metrics.goodput(g.ratio, g.lost)
        reason = self.spot.check(now)
        if reason:
            self.request_stop(f"spot interruption: {reason}")

    # --- states -------------------------------------------------------------------------------
    def _preflight(self) -> State:
        r = self.recipe
        placement = place(r.run.output_dir, self.hash, semantic_view(r), r.run.on_drift)
        if placement.output_dir != Path(r.run.output_dir):
            r = self.recipe = r.model_copy(update={"run": r.run.model_copy(update={"output_dir": str(placement.output_dir)})})
        self.out = Path(r.run.output_dir)
        self.state_dir = state_dir(self.out)
        self.run_id = run_id(self.out)
        lock = RunLock(self.out)
        lock.acquire()  # raises when another supervisor runs this directory
        self.lock = lock
        self.journal = Journal(journal_path(self.state_dir), echo=self.echo)
        self.publish_lock = PublishLock(r.run.persistent_dir, r.run.name, self.hash, self.out)
        self.publish_lock.acquire()  # raises when another supervisor publishes into this run's directory
        if placement.note:
            self.journal.event("drift", placement.note, keys=list(placement.drifted_keys))
        failed = [c for c in plan.preflight(r, self.gpus.snapshot()) if not c.ok and c.fatal]
        if failed:
            raise RecipeError("; ".join(f"pre-flight {c.name}: {c.detail}" for c in failed))
        self._stop_predecessor()
        # the sidecar starts below, after any quarantine, so it never publishes a poisoned checkpoint
        self.checkpoints = RunCheckpoints(r, self.hash, self.out, self.journal, self.metrics,
                                          on_saved=lambda: self.sidecar.trigger(),
                                          restore=lambda: self.sidecar.restore_newest())
        previous = self.journal.get_all()
        pending = previous.get("nan_pending")
        if pending:  # the predecessor saw a NaN and was killed before its quarantine; its trainer is stopped now
            self.checkpoints.quarantine(pending["step"], pending["attempt"])
        self.attempts = len(self.journal.attempts())
        self.metrics.set_info(r.run.name, self.hash, r.run.backend, Path(r.model.path).name)
        if r.metrics.enabled:
            try:
                self.metrics_port = self.metrics.serve(r.metrics.listen)
                self.journal.put(metrics_port=self.metrics_port)
            except OSError as e:  # a taken metrics port must not cost the run; the down alert will show it
                self.journal.event("metrics", f"cannot listen on {r.metrics.listen}: {e}")
        self.journal.put(recipe_hash=self.hash, semantic_view=semantic_view(r), run=r.run.name,
                         backend=r.run.backend, output_dir=str(self.out), supervisor_pid=os.getpid())
        self.sidecar = Sidecar(r, self.hash, self.journal, self.metrics)
        self.sidecar.start()
        self.notifier.ready(f"preflight ok, recipe {self.hash[:12]}")
        if previous.get("state") == State.COMPLETED.value and previous.get("recipe_hash") == self.hash:
            self.journal.event("complete", "this run already completed: nothing to launch (final sync only)")
            return State.COMPLETED
        return State.VERIFYING

    def _stop_predecessor(self) -> None:
        """A supervisor killed with -9 leaves its trainer running: never two trainings on the GPUs."""
        last = self.journal.last_attempt()
        pgids = {last.pid} if last and last.ended_at is None and last.pid and \
            launcher.same_process(last.pid, last.pid_start_time) else set()
        leftovers = launcher.run_processes(self.run_id)
        if pgids or leftovers:
            self.journal.event("predecessor", f"stopping {len(leftovers)} process(es) left by an earlier supervisor",
                               pids=[p.pid for p in leftovers])
            launcher.terminate(self.run_id, pgids, self.recipe.supervisor.grace_s)
        if last and last.ended_at is None:
            self.journal.record_attempt(replace(last, ended_at=self.clock(), cls=last.cls,
                                                 evidence=("supervisor restarted while this attempt ran",)))

    def _verify_gpus(self) -> State:
        if self.stop_event.is_set():
            return State.STOPPED
        if not self.recipe.gpu.check:
            return self._launch_state()
        started = self.clock()
        clear, problems = self._gpus_clear()
        if not clear:
            self._clear_gpus(problems)
            self._sleep(self.recipe.supervisor.force_wait_s)
            clear, problems = self._gpus_clear()
        self.journal.span(started, self.clock(), "verify")
        if clear:
            self.gpu_backoff_s = 0.0
            return self._launch_state()
        s = self.recipe.supervisor
        self.gpu_backoff_s = min(s.backoff_max_s, max(self.gpu_backoff_s * 2, s.force_wait_s, 1.0))
        self.journal.event("gpus_not_clear", "; ".join(problems), retry_in_s=self.gpu_backoff_s)
        self._sleep(self.gpu_backoff_s)
        return State.VERIFYING

    def _launch(self) -> State:
        r, now = self.recipe, self.clock()
        resume = self.checkpoints.resume_point()
        lo, hi = r.supervisor.port_range
        if self.port is None or (self.decision and self.decision.new_port) or not plan.port_free(self.port):
            self.port = plan.first_free_port(lo, hi, avoid={self.port} if self.port else set())
        if self.port is None:
            self.journal.event("port", f"no free rendezvous port in {lo}-{hi}; retrying")
            self._sleep(r.supervisor.wait_s)
            return State.VERIFYING
        self.attempts += 1
        cmd = render_command(r, resume, self.port)
        log = self.state_dir / "attempts" / f"attempt-{self.attempts:04d}.log"
        # The row first: a supervisor killed right after the launch leaves a row its successor closes.
        self._record(Attempt(self.attempts, now, port=self.port, resumed_from=resume.path if resume else None,
                             log_path=str(log), start_step=resume.step if resume else 0))
        launched = launcher.launch(cmd, log, self.run_id, cwd=str(self.out))
        self._record(replace(self._current, pid=launched.pid, pid_start_time=launched.create_time))
        self.attempt = AttemptWatch.start(self.attempts, launched, self.port, resume, self.out)
        self.good_step_at_launch = resume.step if resume else -1
        self.checkpoints.forget_after(self.good_step_at_launch)
        self.journal.event("launch", f"attempt {self.attempts} pid {launched.pid} port {self.port}"
                           + (f" resuming from {resume.path}" if resume else " fresh"), argv=list(cmd.argv))
        if self.attempts > 1:
            self.metrics.restart()
        self.decision = self.crash = None
        return State.RUNNING

    def _watch(self) -> State:
        a, s = self.attempt, self.recipe.supervisor
        a.launched.exited.wait(s.poll_s)  # wakes at once on exit
        now = self.clock()
        for p in a.gather(now):
            self.metrics.observe_progress(p)
        if self.echo and a.last and now - self.echoed_at >= ECHO_PROGRESS_S:
            self.echoed_at = now
            loss = f" loss {a.last.loss:.4g}" if a.last.loss is not None else ""
            self.echo(f"{time.strftime('%H:%M:%S')} progress: step {a.last.step}/{a.last.max_steps}{loss}")
        self._scan_checkpoints(now)
        self._pass_done()
        if a.launched.exited.is_set():
            a.gather(now, drain=True)  # everything it wrote before exiting, however much
        if a.bad:  # also when the trainer exited after the NaN (a crash, or max steps) before this pass
            self.journal.put(nan_pending={"attempt": a.n, "step": a.bad_step})  # survives a kill before _clean
            return self._crashed(Crash(CrashClass.NAN_LOSS, a.bad, Phase.TRAINING))
        if a.launched.exited.is_set():
            return State.COMPLETED if a.done and a.launched.status.code == 0 else self._crashed(None)
        if self.stop_event.is_set():
            return State.STOPPING
        divergence = self._resume_divergence()
        if divergence:
            self.metrics.resume_divergence()
            self.journal.event("resume_divergence", divergence)
            self.exit_reason = f"resume divergence: {divergence}"
            launcher.terminate(self.run_id, {a.launched.pid}, s.grace_s)
            return State.GAVE_UP
        hang = policy.hang_verdict(now, a.launched.started_at, a.last_step_at, s.hang_timeout_s, s.startup_timeout_s)
        if hang:
            self.hang_at = now
            launcher.dump_stacks([p.pid for p in launcher.tree(a.launched.pid)], self.state_dir / f"stacks-{a.n:04d}.txt")
            return self._crashed(Crash(CrashClass.NCCL_TIMEOUT_HANG, (hang,), self._phase()))
        return State.RUNNING

    def _crashed(self, found: Crash | None) -> State:
        """`found`: what the supervisor itself saw (hang, NaN); otherwise classify the log."""
        a = self.attempt
        if found is None:
            found = classify.classify(launcher.read_tail(a.launched.log_path), a.launched.status, self._phase())
            if a.launched.status.code == 0 and found.cls is CrashClass.OTHER:
                last = a.last.step if a.last else None
                found = Crash(CrashClass.OTHER, (f"trainer exited 0 at step {last} before max steps",) + found.evidence,
                              found.phase)
        self.crash = found
        return State.CRASHED

    def _decide(self) -> State:
        now, crash = self.clock(), self.crash
        progressed = self.checkpoints.newest_good_step() > self.good_step_at_launch
        self.decision = policy.decide(crash, self.history, self.recipe.supervisor, now, progressed)
        self.history = policy.next_history(self.history, crash, now, progressed)
        self.metrics.crash(crash.cls)
        self.journal.event("crash", f"attempt {self.attempt.n}: {crash.cls.value} -> {self.decision.action.value}:"
                           f" {self.decision.reason}", evidence=list(crash.evidence))
        if self.decision.alert:
            self.metrics.alert(self.decision.alert, True)
        return State.CLEANING

    def _clean(self) -> State:
        started = self.clock()
        killed = launcher.terminate(self.run_id, {self.attempt.launched.pid}, self.recipe.supervisor.grace_s)
        if killed:
            self.journal.event("cleanup", f"SIGKILLed {len(killed)} process(es) that ignored SIGTERM", pids=killed)
        self._finish_attempt(self.crash)
        if self.crash.cls is CrashClass.NAN_LOSS and self.attempt.bad_step is not None:
            self.checkpoints.quarantine(self.attempt.bad_step, self.attempt.n)
        self.journal.span(started, self.clock(), "cleanup")
        if self.decision.action is Action.GIVE_UP:
            self.exit_reason = self.decision.reason
            return State.GAVE_UP
        return State.BACKOFF if self.decision.backoff_s else State.WAITING

    def _wait(self) -> State:
        d, started = self.decision, self.clock()
        if self._sleep(d.wait_s + d.backoff_s):
            return State.STOPPED
        if d.action is Action.WAIT_FOR_SPACE:
            free, need = plan.free_gib(self.recipe.run.output_dir), self.recipe.supervisor.min_free_gib
            if free < need:
                self.journal.event("disk_full", f"{self.recipe.run.output_dir}: {free:.1f} GiB free, waiting for {need:g}")
                self._pass_done()
                return State.WAITING
            self.metrics.alert("disk_full", False)
        self.journal.span(started, self.clock(), "backoff" if d.backoff_s else "wait")
        if d.alert == "crash_loop":
            self.metrics.alert("crash_loop", False)
        self._pass_done()
        return State.VERIFYING

    def _stop(self) -> State:
        self.journal.event("stop", f"stopping: {self.stop_reason}")
        launcher.terminate(self.run_id, {self.attempt.launched.pid}, self.recipe.supervisor.grace_s)
        self._scan_checkpoints(self.clock())
        self._finish_attempt(Crash(CrashClass.OTHER, (f"stopped by orchestrator: {self.stop_reason}",)), stopped=True)
        return State.STOPPED

    # --- helpers ------------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> bool:
        """A deliberate wait: interruptible by a stop, and the loop keeps reporting (watchdog, spot)."""
        return self.heartbeat.wait(self.stop_event, seconds, tick=self._pass_done)

    def _launch_state(self) -> State:
        return State.RELAUNCHING if self.attempts else State.LAUNCHING

    def _phase(self) -> Phase:
        return Phase.TRAINING if self.attempt and self.attempt.first_step is not None else Phase.STARTUP

    def _gpus_clear(self) -> tuple[bool, list[str]]:
        snap = self.gpus.snapshot()
        self.metrics.gpu_memory(snap)
        indices = gpu.run_gpus(self.recipe.parallel.nproc_per_node, self.recipe.env.vars.get("CUDA_VISIBLE_DEVICES"))
        clear, problems = gpu.clear_verdict(snap, indices, self.recipe.gpu.clear_threshold_mib)
        self.metrics.gpus_clear(clear, self.clock())
        self._gpu_snapshot, self._gpu_indices = snap, indices
        return clear, problems

    def _clear_gpus(self, problems: list[str]) -> None:
        """Kill our own leftovers; a foreign holder only when its command line matches gpu.kill_patterns."""
        own = {p.pid for p in launcher.run_processes(self.run_id)}
        foreign = gpu.holders(self._gpu_snapshot, self._gpu_indices) - own
        allowed = [pid for pid in foreign
                   if any(re.search(pat, launcher.cmdline(pid)) for pat in self.recipe.gpu.kill_patterns)]
        launcher.kill_pids(sorted(own | set(allowed)))
        spared = sorted(foreign - set(allowed))
        self.journal.event("gpus_not_clear", "; ".join(problems), killed_own=sorted(own), killed_foreign=allowed,
                           spared_foreign=spared)

    def _scan_checkpoints(self, now: float) -> None:
        if now - self.last_scan < CHECKPOINT_SCAN_S and self.state is State.RUNNING \
                and not self.attempt.launched.exited.is_set():
            return
        self.last_scan = now
        self.checkpoints.scan(now)

    def _resume_divergence(self) -> str | None:
        a = self.attempt
        if a.resume is None or a.first_logged is None or a.resume_checked:
            return None
        a.resume_checked = True
        p = a.first_logged
        return policy.resume_verdict(a.resume.step, p.step, p.loss, a.prior_losses.get(p.step),
                                     self.recipe.checkpoint.logging_steps, self.recipe.checkpoint.resume_loss_tolerance)

    def _record(self, attempt: Attempt) -> None:
        self._current = attempt
        self.journal.record_attempt(attempt)

    def _finish_attempt(self, crash: Crash, stopped: bool = False) -> None:
        a = self.attempt
        a.launched.exited.wait(10)  # the reaper records the exit status right after terminate()
        st = a.launched.status
        self._record(replace(self._current, ended_at=self.clock(), exit_code=st.code if st else None,
                              signal=st.signal if st else None, cls=None if stopped else crash.cls,
                              evidence=crash.evidence, end_step=a.last.step if a.last else None,
                              first_step_at=a.first_step_at, last_step_at=a.last_step_at,
                              hang_detected_at=self.hang_at))
        self.hang_at = None

    def _shutdown(self) -> None:
        if not self.sidecar:  # pre-flight did not finish: nothing ran
            if self.lock:
                self.journal.close()
                self.lock.release()
                if self.publish_lock:
                    self.publish_lock.release()
            return
        if self.state is State.COMPLETED and self.attempt:
            self._scan_checkpoints(self.clock())
            self._finish_attempt(Crash(CrashClass.OTHER), stopped=True)
        if self.state is State.GAVE_UP:
            self.journal.event("gave_up", self.exit_reason)
        self.notifier.stopping(f"{self.state.value}: final sync")  # disarms the watchdog for the final sync
        self.checkpoints.close()  # manifests first: the final sync publishes what they describe
        self.sidecar.stop(final_sync=True)
        self.goodput_at = 0.0
        self._pass_done()  # final goodput and sync figures
        if self.state is State.GAVE_UP and self.recipe.metrics.enabled:
            self.stop_event.wait(self.recipe.metrics.linger_s)  # let Prometheus scrape gave_up
        self.journal.put(state=self.state.value, exit_reason=self.exit_reason, updated_at=self.clock())
        self.metrics.close()
        self.journal.close()
        self.lock.release()
        self.publish_lock.release()

