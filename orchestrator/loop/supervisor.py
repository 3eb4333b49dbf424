"""The supervisor: one loop, one state machine. Each state's handler does that state's work and returns the next
state; `_enter` is the one place a state changes, and it checks the change against types.TRANSITIONS (an
unexpected one is a bug and raises). The machine (processes, GPUs, ports, disk, the clock) is reached only
through the Host port (host/base.py), so every transition is table-tested with an in-memory host
(tests/test_state_machine.py). Decisions are pure functions (domain/); the parts of the loop receive what they
use in their constructors:

    run.py        RunContext: everything PREFLIGHT opens (journal, locks, checkpoints, publisher, intervals)
    ticker.py     the per-pass housekeeping, deliberate waits, goodput spans
    launch.py     (RE)LAUNCHING                    running.py   RUNNING: observe -> judge -> act
    health.py     run health in RUNNING: loss, grad norm, resume, unreadable progress, throughput
    recovery.py   VERIFYING, CRASHED, CLEANING, WAITING/BACKOFF
    export.py     checkpoint.merge = "final": the export attempt after the training

The transitions (generated from types.TRANSITIONS; tests/test_transitions.py keeps this block in step):

{transitions}
"""
from __future__ import annotations

import signal
import threading

from orchestrator.config.recipe import Recipe, recipe_hash
from orchestrator.host import gpu
from orchestrator.host.base import Host
from orchestrator.host.metrics import Metrics
from orchestrator.host.notify import Heartbeat, Notifier
from orchestrator.host.slurm_host import host_for
from orchestrator.host.spot import from_recipe as spot_notice
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.export import ExportPhase
from orchestrator.loop.gpu_gate import GpuGate
from orchestrator.loop.health import RunHealth
from orchestrator.loop.launch import Launcher
from orchestrator.loop.recovery import Recovery
from orchestrator.loop.run import RunContext, open_run
from orchestrator.loop.running import (Crashed, ExportExited, HealthStop, Keep, Observer, ResumedAtWrongStep,
                                       RolledBack, SlowRestart, StopRequested, TrainingOver, judge_pass)
from orchestrator.loop.states import transitions_text
from orchestrator.loop.ticker import Ticker
from orchestrator.store.standing import SetAside
from orchestrator.types import TERMINAL_STATES, TRANSITIONS, Crash, CrashClass, ExitCode, HealthKind, SetAsideReason, State

__doc__ = (__doc__ or "").format(transitions=transitions_text())


SET_ASIDE_FINAL_WAIT_S = 60.0   # at exit, how long a set-aside waits for a sync round's lock


class TransitionError(RuntimeError):
    """A handler returned a state types.TRANSITIONS does not allow from the current one: a bug."""


class Parts:
    """The loop's parts, made once PREFLIGHT has opened the run."""

    def __init__(self, sup: Supervisor, ctx: RunContext):
        self.ticker = Ticker(sup.host, ctx.journal, ctx.publisher, sup.metrics, sup.heartbeat, sup.spot,
                             sup.stop_event, sup.request_stop, lambda: sup.attempt,
                             lambda: ctx.apply_set_asides(local=False))
        self.export = ExportPhase(ctx, sup.hash, sup.host)
        self.recovery = Recovery(ctx, sup.host, sup.gpus, sup.metrics, self.ticker, sup.stop_event, sup.request_stop)
        self.launcher = Launcher(ctx, sup.host, sup.gpus, sup.metrics, sup.notifier, self.ticker, self.export,
                                 sup.stop_event)
        self.health = RunHealth(ctx, sup.host, sup.metrics)
        self.observer = Observer(ctx, sup.host, sup.metrics, self.ticker, self.health, sup.stop_event.is_set, sup.echo)


class Supervisor:
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
        self.attempt: AttemptWatch | None = None  # the running (or last) attempt
        self.exit_reason = ""
        self.metrics = Metrics(sync_enabled=recipe.run.persistent_dir is not None, clock=self.host.now,
                               max_crashes_per_hour=recipe.supervisor.max_crashes_per_hour)
        self.notifier = Notifier.from_env()
        self.heartbeat = Heartbeat(self.notifier, clock=self.host.monotonic)
        self.spot = spot_notice(recipe.supervisor)
        self.gpus = GpuGate(recipe, self.host, self.metrics)
        self.ctx: RunContext | None = None    # opened by PREFLIGHT
        self.parts: Parts | None = None
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # USR1: Slurm's --signal ahead of the time limit
                signal.signal(sig, lambda s, _f: self.request_stop(f"signal {signal.Signals(s).name}"))

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> ExitCode:
        """Supervises until a terminal state; returns the exit code."""
        try:
            while self.state not in TERMINAL_STATES:
                self.step()
        finally:
            self.shutdown()
        return ExitCode.GAVE_UP if self.state is State.GAVE_UP else ExitCode.OK

    def step(self) -> State:
        """Does one state's work: runs its handler and enters the state it returns (the table tests call this)."""
        handler = {
            State.PREFLIGHT: self._preflight, State.VERIFYING: self._verifying,
            State.LAUNCHING: self._launch, State.RELAUNCHING: self._launch, State.RUNNING: self._running,
            State.CRASHED: self._crashed, State.CLEANING: self._cleaning, State.WAITING: self._waiting,
            State.BACKOFF: self._waiting, State.STOPPING: self._stopping,
        }[self.state]
        self._enter(handler())
        return self.state

    def request_stop(self, reason: str) -> None:
        """Asks the loop to stop gracefully (a signal, a spot notice, a requeue)."""
        self.stop_reason = self.stop_reason or reason
        self.stop_event.set()

    def _enter(self, state: State) -> None:
        if state not in TRANSITIONS[self.state]:
            raise TransitionError(f"{self.state.value} -> {state.value} is not in types.TRANSITIONS")
        journal = self._ctx.journal
        if state is not self.state:
            journal.event("state", f"{self.state.value} -> {state.value}")
        if self.state is State.RUNNING and state is not State.RUNNING:  # the attempt ends (or is being ended)
            self._end_attempt()
        self.state = state
        self.metrics.set_state(state)
        step = self.attempt.last.step if self.attempt and self.attempt.last else None
        journal.put(state=state.value, updated_at=self.host.now(), attempt=self.attempt.n if self.attempt else 0,
                    **({"step": step} if step is not None else {}))  # keep the last step across a relaunch
        self.notifier.status(f"{state.value}" + (f" step {step}" if step is not None else ""))

    def _begin_attempt(self, a: AttemptWatch) -> None:
        """Starts everything that belongs to one attempt, in one place (supervisord's spawn()): run health's
        detectors and throughput tracker for it, the GPU backoff from zero."""
        self._parts.health.start(a)
        self._parts.recovery.gpu_backoff_s = 0.0

    def _end_attempt(self) -> None:
        """Ends what belongs to the attempt leaving RUNNING: its open slow spell, its throughput_drop alert."""
        self._parts.health.end(self.host.now())

    @property
    def _ctx(self) -> RunContext:
        assert self.ctx is not None, "the run is opened by PREFLIGHT"
        return self.ctx

    @property
    def _parts(self) -> Parts:
        assert self.parts is not None, "the loop's parts are made by PREFLIGHT"
        return self.parts

    @property
    def _attempt(self) -> AttemptWatch:
        assert self.attempt is not None, "only states after a launch act on the attempt"
        return self.attempt

    # --- states -------------------------------------------------------------------------------
    def _preflight(self) -> State:
        self.ctx = ctx = open_run(self.recipe, self.hash, self.host, self.metrics, self.echo)
        self.recipe = ctx.recipe  # as placed
        self.parts = Parts(self, ctx)
        self.notifier.ready(f"preflight ok, recipe {self.hash[:12]}")
        if ctx.completed_before:
            ctx.journal.event("complete", "this run already completed: nothing to launch (final sync only)")
            return State.COMPLETED
        return State.VERIFYING

    def _verifying(self) -> State:
        return self._parts.recovery.verify_gpus(relaunch=self.attempt is not None)

    def _launch(self) -> State:
        launcher = self._parts.launcher
        state, launched = launcher.launch(self.attempt)
        if launched:
            self.attempt = launched
            self._begin_attempt(launched)
        self.exit_reason = launcher.exit_reason or self.exit_reason
        return state

    def _running(self) -> State:
        """RUNNING: observe -> judge -> act (loop/running.py); the acting is here, in one place."""
        a, parts = self._attempt, self._parts
        obs = parts.observer.observe(a)
        judged = judge_pass(obs)
        parts.health.record(judged.events)  # warnings too, whatever the verdict; each with the action taken
        # a content finding's checkpoint moves now; the one the trainer was launched from, or a range, once it stopped
        self._ctx.apply_set_asides(busy=frozenset({a.resume.path} if a.resume else ()))
        match judged.verdict:
            case Keep():
                return State.RUNNING
            case Crashed(crash=crash, nan_step=nan_step, hang=hang, set_aside_from=first):
                if nan_step is not None and first is not None:  # durable before the cleanup moves anything
                    self._ctx.journal.put(nan_pending={"attempt": a.n, "step": nan_step})
                    cause = f"written at or after the NaN at step {nan_step}" + (
                        f" (run health's onset at step {first})" if first < nan_step else "")
                    self._ctx.standings.request(SetAside(first, SetAsideReason.NAN, a.n, cause))
                    parts.health.set_aside_from(first, a.last.step if a.last else None)
                if hang:
                    a.hang_at = self.host.now()
                    self.host.dump_stacks(a.launched.pid, self._ctx.state_dir / f"stacks-{a.n:04d}.txt")
                return parts.recovery.crashed(a, crash)
            case TrainingOver(teardown_failure=teardown):
                if teardown:
                    self._ctx.journal.event("teardown_failure", teardown)
                return parts.export.after_training(a)
            case ExportExited():
                exported = parts.export.export_exited(a)
                return exported if isinstance(exported, State) else parts.recovery.crashed(a, exported)
            case StopRequested():
                return State.STOPPING
            case ResumedAtWrongStep(detail=detail):
                return self._give_up_on_wrong_step(a, detail)
            case HealthStop(reason=reason, set_aside_from=first):
                self._stop_attempt(a, reason)
                if first is not None:  # kept for a person, never resumed from, published or exported
                    self._ctx.set_aside(first, SetAsideReason.DIVERGED, a.n, f"written at or after the onset of a "
                                        f"divergence at step {first} (the run stopped)")
                self.exit_reason = reason
                return State.GAVE_UP
            case RolledBack(action=action, resume_suspect=suspect, set_aside_from=first):
                self._stop_attempt(a, action.reason)
                assert first is not None
                self._ctx.set_aside(first, SetAsideReason.SUSPECT if suspect else SetAsideReason.DIVERGED, a.n,
                                    f"written at or after the onset of a divergence at step {first}")
                parts.health.set_aside_from(first, a.last.step if a.last else None, suspect)
                return State.VERIFYING
            case SlowRestart(reason=reason):
                parts.health.restarted(obs.now)   # at most one restart per hour, counted from this one
                self._stop_attempt(a, reason)
                return State.VERIFYING
        raise AssertionError("judge returned an unknown verdict")

    def _crashed(self) -> State:
        return self._parts.recovery.decide(self._attempt)

    def _cleaning(self) -> State:
        a = self._attempt
        state = self._parts.recovery.clean(a)
        if state is State.GAVE_UP and a.decision:
            self.exit_reason = a.decision.reason
        return state

    def _waiting(self) -> State:
        return self._parts.recovery.wait(self._attempt)

    def _stopping(self) -> State:
        a = self._attempt
        self._ctx.journal.event("stop", f"stopping: {self.stop_reason}")
        self._stop_attempt(a, self.stop_reason)
        return State.STOPPED

    def _stop_attempt(self, a: AttemptWatch, why: str) -> None:
        """Stops the trainer gracefully (SIGTERM: ms-swift saves; grace_s, then SIGKILL), reads what it wrote on
        the way out and finishes its row as stopped by the orchestrator, saying why."""
        ctx = self._ctx
        self.host.terminate(ctx.run_id, {a.launched.pid}, self.recipe.supervisor.grace_s)
        self.host.wait_exit(a.launched, 10)  # the exit status is recorded right after terminate()
        self._parts.observer.drain(a)  # the steps and the checkpoint it wrote on the way out
        a.finish(ctx.journal, self.host, Crash(CrashClass.OTHER, (f"stopped by orchestrator: {why}",)), stopped=True)

    def _give_up_on_wrong_step(self, a: AttemptWatch, detail: str) -> State:
        """The resumed trainer's first logged step does not follow its checkpoint (the step check,
        `resumed_at_wrong_step`; the losses are run health's `resume_divergence`): retrying cannot help. The
        trainer is stopped and its row finished, saying why."""
        self.metrics.health_event(HealthKind.RESUMED_AT_WRONG_STEP)
        self._ctx.journal.event(HealthKind.RESUMED_AT_WRONG_STEP, detail)
        self.exit_reason = f"resumed at the wrong step: {detail}"
        self._stop_attempt(a, self.exit_reason)
        return State.GAVE_UP

    # --- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Closes the run: the open attempt's row finished, the final sync, the last prune, the final record,
        the locks released. Does nothing before PREFLIGHT opened the run, or a second time."""
        ctx, parts = self.ctx, self.parts
        if ctx is None or parts is None or ctx.closed:
            return
        try:
            a = self.attempt
            if self.state in TERMINAL_STATES and a and a.open:  # every terminal path finishes the running attempt
                parts.observer.drain(a)
                a.finish(ctx.journal, self.host, Crash(CrashClass.OTHER), stopped=True)
            if self.state is State.GAVE_UP:
                ctx.journal.event("gave_up", self.exit_reason)
            self.notifier.stopping(f"{self.state.value}: final sync")  # disarms the watchdog for the final sync
            ctx.checkpoints.close(move=False)  # manifests and checks first: the final sync publishes the healthy ones
            alive = None if self.state in TERMINAL_STATES or a is None else frozenset(
                {a.resume.path} if a.resume else ())   # a supervisor bug mid-attempt: its trainer may still write
            if not ctx.apply_set_asides(busy=alive, wait_s=SET_ASIDE_FINAL_WAIT_S):
                ctx.journal.event("quarantine", "set-asides still pending at exit (the sync lock stayed taken): the next "
                                  "start moves them first", pending=[p.to_json() for p in ctx.standings.pending])
            ctx.publisher.stop(final_sync=True)
            ctx.checkpoints.prune(ctx.keep_local, pressure=False, writing=False)  # what the final sync published
            parts.ticker.housekeeping(goodput_now=True)  # final goodput and sync figures
            if self.state is State.GAVE_UP and self.recipe.metrics.enabled:
                self.host.wait(self.stop_event, self.recipe.metrics.linger_s)  # let Prometheus scrape gave_up
            ctx.journal.put(state=self.state.value, exit_reason=self.exit_reason, updated_at=self.host.now())
        finally:  # a failure on the way out must not keep the run's locks (its successor could not start)
            self.metrics.close()
            ctx.release()
