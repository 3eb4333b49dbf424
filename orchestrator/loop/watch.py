"""Watch mode (`orchestrator watch`): the supervisor's RUNNING pass over a trainer someone started by hand, with
its act replaced by advice, and, on request, the hand-off to a Supervisor of the same run.

    open        the run opened with act=False (loop/run.py): same journal, metrics, publisher and checkpoint
                tracker as `run`, but nothing stopped, renamed or deleted; one attempt of kind `observed`,
                its start time the process's (/proc), its log the trainer's stdout file (or --log)
    each pass   Observer.observe -> judge, as `run` does (loop/running.py); advise() says what `run` would do
                (loop/advice.py): an `advice` journal event, orchestrator_advice_total{action}, a console line,
                each distinct advice once; unhealthy checkpoints are advised and left in place
    the end     completed: exit 0. Ended badly: classified from the log and the machine's evidence (the exit
                status is unknown when the process was not our child and its parent reaped it: said so), the
                crash policy's decision advised, exit 3; with take_over, a Supervisor of the same run relaunches
                from the newest healthy checkpoint (attempt numbers continue the journal's)
    a hang      advice (stacks dumped); with take_over = "hang" the watched trainer is stopped and taken over

Never signals the watched trainer, except a hang under take_over = "hang".
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from orchestrator.config.recipe import Recipe, recipe_hash
from orchestrator.domain import classify, policy, verdict
from orchestrator.host import gpu
from orchestrator.host.base import Host
from orchestrator.host.launch.local import FileTail, read_tail
from orchestrator.host.metrics import Metrics
from orchestrator.host.notify import Heartbeat, Notifier
from orchestrator.host.slurm_host import host_for
from orchestrator.host.spot import from_recipe as spot_notice
from orchestrator.host.trainer_find import WatchedTrainer
from orchestrator.loop.advice import Advice, At, Exited, UnfitCheckpoint, advise
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.gpu_gate import GpuGate
from orchestrator.loop.health import RunHealth
from orchestrator.loop.run import open_run
from orchestrator.loop.running import (Crashed, HealthStop, Keep, Observation, Observer, RolledBack, SlowRestart,
                                       StopRequested, TrainingOver, judge_pass)
from orchestrator.loop.ticker import Ticker
from orchestrator.store.checkpoints import logged_losses
from orchestrator.store.standing import SetAside
from orchestrator.types import (GIB, Action, Attempt, AttemptKind, Crash, CrashClass, ExitCode, ExitStatus, Phase,
                                Progress, SetAsideReason, State)
from orchestrator.domain import progress

BACKLOG_BYTES = 4 << 20   # the end of the log read at attach, for the last step logged before the watch began
HAND_OFF = "hand_off"     # Watch.run's answer when the run is to be handed to a Supervisor
VANISHED = ("the trainer ended mid-run and its log says nothing of why: judged as a SIGKILL (the kernel's OOM "
            "killer or a kill -9), which ends a process so")


class MultiTail:
    """New lines of several files (stdout and stderr written apart), as one FileTail."""

    def __init__(self, paths: list[Path]):
        self.tails = [FileTail(p, from_end=True) for p in paths]

    def lines(self, max_bytes: int | None = 8 << 20) -> list[str]:
        return [line for t in self.tails for line in t.lines(max_bytes)]


def known(status: ExitStatus | None) -> bool:
    """The exit status was read (a zombie's), not unknown."""
    return status is not None and (status.code is not None or status.signal is not None)


def as_judged(obs: Observation) -> Observation:
    """The observation judge() reads: an unknown exit after every step was logged is judged as exit 0 (complete
    unless the last save is torn); any other unknown exit stays an exit to classify."""
    if obs.exit is not None and not known(obs.exit) and obs.at_end:
        return replace(obs, exit=ExitStatus(code=0))
    return obs


class Watch:
    def __init__(self, recipe: Recipe, trainer: WatchedTrainer, logs: list[Path], *, recipe_arg: str,
                 take_over: str | None = None, host: Host | None = None, install_signals: bool = True,
                 echo: Callable[[str], None] | None = None):
        """`logs`: the files the trainer's output goes to ([]: logging.jsonl only); `recipe_arg`: the recipe as
        the user named it (for the advice's commands); `take_over`: None, "crash" or "hang"."""
        self.recipe, self.trainer, self.logs, self.recipe_arg = recipe, trainer, logs, recipe_arg
        self.take_over, self.echo = take_over, echo
        self.host: Host = host or host_for(recipe, gpu.reader(recipe.gpu.check))
        self.hash = recipe_hash(recipe)
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.metrics = Metrics(sync_enabled=recipe.run.persistent_dir is not None, clock=self.host.now,
                               max_crashes_per_hour=recipe.supervisor.max_crashes_per_hour)
        self.heartbeat = Heartbeat(Notifier.from_env(), clock=self.host.monotonic)
        self.advised: set[tuple[str, str]] = set()
        self.poisoned = False             # a NaN was logged: nothing more is published
        self.blocked = ""                 # run health advised a stop or rollback: no automatic take-over
        self.hang_step: int | None = None  # the last step when the hang was advised (a new step re-arms it)
        self.attempt: AttemptWatch | None = None
        self.exit_reason = ""
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda s, _f: self.request_stop(f"signal {signal.Signals(s).name}"))

    def request_stop(self, reason: str) -> None:
        """Asks the watch to end (the trainer goes on)."""
        self.stop_reason = self.stop_reason or reason
        self.stop_event.set()

    # --- the watch ----------------------------------------------------------------------------
    def run(self) -> ExitCode | str:
        """Watches until the trainer ends (or the watcher is stopped); returns the exit code, or HAND_OFF."""
        ctx = open_run(self.recipe, self.hash, self.host, self.metrics, self.echo, act=False)
        self.ctx = ctx
        ticker = Ticker(self.host, ctx.journal, ctx.publisher, self.metrics, self.heartbeat,
                        spot_notice(self.recipe.supervisor), self.stop_event, self.request_stop, lambda: self.attempt)
        self.ticker, self.health = ticker, RunHealth(ctx, self.host, self.metrics)
        self.observer = Observer(ctx, self.host, self.metrics, ticker, self.health, self.stop_event.is_set, self.echo)
        state = State.GAVE_UP
        try:
            a = self.attempt = self._attach()
            self.health.start(a)
            state, result = self._watch(a)
        finally:
            self._close(state)
        return result

    def _attach(self) -> AttemptWatch:
        """The observed attempt: its row (kind observed, started when the process started), the log tails from
        now on, the last step the log shows so far, the machine's evidence baseline."""
        ctx, t = self.ctx, self.trainer
        n = ctx.attempts_before + 1
        row = Attempt(n, t.started_at, pid=t.pid, pid_start_time=t.create_time, kind=AttemptKind.OBSERVED,
                      log_path=str(self.logs[0]) if self.logs else None)
        jsonl = ctx.out / "logging.jsonl"
        a = AttemptWatch(n, t, 0, None, row, MultiTail(self.logs), FileTail(jsonl, from_end=True),  # type: ignore[arg-type]
                         logged_losses(jsonl), output_dir=ctx.out)
        a.last = self._last_logged(jsonl)
        if a.last is not None:  # in training: the hang timer runs from now, the phase is training
            a.first_step, a.last_step_mono = a.last.step, self.host.monotonic()
            a.row = replace(a.row, end_step=a.last.step)
        a.record(ctx.journal, a.row)
        self.host.evidence_baseline(t, ctx.run_id, GpuGate(self.recipe, self.host, self.metrics).run_gpus()
                                    if self.recipe.gpu.check else [])
        ctx.journal.event("watch", f"attempt {n}: watching pid {t.pid} (started by hand, not by the orchestrator)"
                          + (f", log {', '.join(map(str, self.logs))}" if self.logs else ", no log file: progress "
                             "from logging.jsonl only") + (f", at step {a.last.step}" if a.last else ""),
                          pid=t.pid, logs=[str(p) for p in self.logs], take_over=self.take_over)
        ctx.journal.put(state=State.RUNNING.value, attempt=n, updated_at=self.host.now(), watching=t.pid,
                        **({"step": a.last.step} if a.last else {}))
        self.metrics.set_state(State.RUNNING)
        return a

    def _last_logged(self, jsonl: Path) -> Progress | None:
        """The newest step record in the end of the logs and of logging.jsonl (what was logged before the watch)."""
        best: Progress | None = None
        for path, parse in [(p, progress.parse_line) for p in self.logs] + [(jsonl, progress.parse_jsonl_line)]:
            text = read_tail(path, BACKLOG_BYTES)
            for line in text.replace("\r", "\n").splitlines():
                p = parse(line)
                if p is not None and (best is None or p.step >= best.step):
                    best = p
        return best

    def _watch(self, a: AttemptWatch) -> tuple[State, ExitCode | str]:
        journal = self.ctx.journal
        while True:
            obs = self.observer.observe(a)
            judged = judge_pass(as_judged(obs))
            self.health.record(judged.events)   # each with the action `run` would take: what is advised
            self._advise_checkpoints(a)
            if a.bad_step is not None and not self.poisoned:
                self._poisoned(a)
            v = judged.verdict
            if isinstance(v, SlowRestart):   # advised, as `run` would restart: at most once per hour too
                self.health.restarted(obs.now)
            journal.put(updated_at=self.host.now(), **({"step": a.last.step} if a.last else {}))
            match v:
                case Keep():
                    continue
                case StopRequested():
                    journal.event("stop", f"watch stopped ({self.stop_reason}); pid {a.launched.pid} goes on")
                    self._finish(a, Crash(CrashClass.OTHER, (f"watch stopped: {self.stop_reason}; the trainer "
                                                             "was left running",)), stopped=True)
                    return State.STOPPED, ExitCode.OK
                case TrainingOver(teardown_failure=teardown):
                    if teardown:
                        journal.event("teardown_failure", teardown)
                    self._finish(a, Crash(CrashClass.OTHER), stopped=True)
                    journal.event("complete", f"the watched trainer completed at step {obs.last_step}")
                    return State.COMPLETED, ExitCode.OK
            if isinstance(v, (HealthStop, RolledBack)):  # no automatic relaunch into a divergence
                self.blocked = self.blocked or self._say(v, a).text
            if obs.exit is None:
                if isinstance(v, Crashed) and v.hang:
                    if (handed := self._hang(a, v)) is not None:
                        return handed
                    continue
                if not isinstance(v, (HealthStop, RolledBack)):
                    self._say(v, a)
                continue
            return self._exited(a, v)

    def _poisoned(self, a: AttemptWatch) -> None:
        """A NaN/Inf was logged: the saves from then on may hold poisoned weights. `run` would quarantine them
        (the pending mark tells the next `run` to); nothing more is published meanwhile."""
        self.poisoned = True
        self.ctx.journal.put(nan_pending={"attempt": a.n, "step": a.bad_step})
        assert a.bad_step is not None
        # in standing at once (never resumed from or published); the copies move when `run` takes the run over
        self.ctx.standings.request(SetAside(a.bad_step, SetAsideReason.NAN, a.n,
                                            f"written at or after the NaN at step {a.bad_step}"))
        self.ctx.publisher.stop(final_sync=False)
        self.ctx.journal.event("publish", f"publishing stopped: NaN/Inf logged at step {a.bad_step}; the saves from "
                               "then on may hold poisoned weights")

    # --- advice -------------------------------------------------------------------------------
    def _at(self, a: AttemptWatch, **more) -> At:
        s = self.recipe.supervisor
        return At(self.recipe_arg, a.launched.pid, self._resume_step(a), s.wait, s.wait_s, nan_step=a.bad_step,
                  **more)

    def _resume_step(self, a: AttemptWatch) -> int | None:
        """The newest verified checkpoint saved before any NaN: where `run` would relaunch from."""
        self.observer.scan(force=True)
        step = self.ctx.checkpoints.newest_good_step(a.bad_step - 1 if a.bad_step is not None else None)
        return step if step >= 0 else None

    def _say(self, what, a: AttemptWatch, **more) -> Advice:
        """Advises once: the journal event, the metric, the console line."""
        adv = advise(what, self._at(a, **more))
        assert adv is not None
        key = (adv.action, adv.text if not isinstance(what, Crashed) or what.hang else adv.action)
        if key not in self.advised:
            self.advised.add(key)
            self.ctx.journal.event("advice", adv.text, action=adv.action, command=adv.command, attempt=a.n)
            self.metrics.advice(adv.action)
            if self.echo:
                self.echo(f"advice: {adv.line()}")
        return adv

    def _advise_checkpoints(self, a: AttemptWatch) -> None:
        tracker = self.ctx.checkpoints
        while tracker.left_in_place:
            f = tracker.left_in_place.pop(0)
            assert f.last_step is not None, f
            self._say(UnfitCheckpoint(f.last_step, f.kind, f.message), a)

    # --- the hang -----------------------------------------------------------------------------
    def _hang(self, a: AttemptWatch, v: Crashed) -> tuple[State, ExitCode | str] | None:
        """A hang: stacks dumped and advised once per stall (a new step re-arms it); with take_over = "hang",
        the trainer is stopped and the run handed off."""
        step = a.last.step if a.last else None
        if a.hang_at is not None and step == self.hang_step:
            return None
        a.hang_at, self.hang_step = self.host.now(), step
        stacks = self.ctx.state_dir / f"stacks-{a.n:04d}.txt"
        self.host.dump_stacks(a.launched.pid, stacks)
        since = a.last_step_mono if a.last_step_mono is not None else a.launched.started_mono
        self._say(v, a, stacks=str(stacks) if stacks.exists() else None, hung_s=self.host.monotonic() - since)
        if self.take_over != "hang":
            return None
        self.ctx.journal.event("take_over", f"attempt {a.n} hung: stopping pid {a.launched.pid} (--take-over=hang)")
        pgid = _pgid(a.launched.pid)
        self.host.terminate(self.ctx.run_id, {pgid} if pgid == a.launched.pid else set(), self.recipe.supervisor.grace_s)
        if self.trainer.alive():  # not its own group leader: its tree, by pid
            self.host.kill(self.trainer.tree())
        self.host.wait_exit(a.launched, self.recipe.supervisor.grace_s + 10)
        self.observer.drain(a)
        assert v.crash is not None
        return self._exited(a, v, v.crash)

    # --- the end ------------------------------------------------------------------------------
    def _exited(self, a: AttemptWatch, v, found: Crash | None = None) -> tuple[State, ExitCode | str]:
        """The trainer ended badly: classified, decided, advised, its row finished; handed off when asked."""
        found = found or (v.crash if isinstance(v, Crashed) else None)
        crash = self._classify(a, found)
        decision = policy.decide(crash, self.ctx.history, self.recipe.supervisor, self.host.now(),
                                 self.ctx.checkpoints.newest_good_step() > a.good_step_at_launch, self._shm_gib(a))
        self.metrics.crash(crash.cls)
        self.ctx.journal.event("crash", f"attempt {a.n}: {crash.cls.value} -> {decision.action.value}: "
                               f"{decision.reason}", evidence=list(crash.evidence))
        status = a.launched.status
        how = str(status) if known(status) else "exit status unknown: not the watcher's child"
        adv = self._say(Exited(v if isinstance(v, Crashed) else Crashed(), crash.cls, decision, how), a)
        self._finish(a, crash)
        self.exit_reason = f"the watched trainer ended: {crash.cls.value}; advice: {adv.text}"
        if self.take_over and decision.action is not Action.GIVE_UP and not self.blocked:
            self.ctx.journal.event("take_over", f"attempt {a.n} ended badly: a supervisor takes the run over")
            self._await_gone()
            return State.VERIFYING, HAND_OFF
        if self.take_over and self.blocked:
            self.ctx.journal.event("take_over", f"not taken over: run health advised: {self.blocked}")
        return State.GAVE_UP, ExitCode.GAVE_UP

    def _classify(self, a: AttemptWatch, found: Crash | None) -> Crash:
        """Names the failure as Recovery.crashed does, the log tails together; an unknown exit status is said."""
        status = a.launched.status
        exit_ = status if known(status) else None
        if found is None:
            text = "\n".join(read_tail(p) for p in self.logs)
            found = classify.classify(text, exit_, a.phase if a.last else Phase.UNKNOWN)
            if exit_ is not None and exit_.code == 0 and found.cls is CrashClass.OTHER:
                found = Crash(CrashClass.OTHER, (f"trainer exited 0 at step {a.last.step if a.last else None} "
                                                 "before max steps",) + found.evidence, found.phase)
            elif exit_ is None and self.logs and not a.at_end and not classify.says_why(text):
                # Gone mid-run without a word, status unknown: only a SIGKILL (the OOM killer's, a kill -9) ends a
                # trainer so (an exception, an exit, a SIGTERM's save all log); judged as one, as `run` would.
                found = Crash(CrashClass.HOST_OOM_KILLED, (VANISHED,) + found.evidence, found.phase)
        r = self.recipe
        paths = {"output_dir": r.run.output_dir, "/dev/shm": "/dev/shm"} | (
            {"persistent_dir": r.run.persistent_dir} if r.run.persistent_dir else {})
        system = self.host.evidence(a.launched, paths, None)
        crash = verdict.combine(found, exit_, system, min(r.supervisor.min_free_gib, 1.0))
        if exit_ is None:
            crash = Crash(crash.cls, (f"exit status unknown: pid {a.launched.pid} was not started by the "
                                      "orchestrator and its parent reaped it; judged from the log and the machine",)
                          + crash.evidence, crash.phase)
        if facts := crash.evidence[:len(crash.evidence) - len(found.evidence)]:
            self.ctx.journal.event("evidence", f"attempt {a.n}: " + "; ".join(facts))
        a.row = replace(a.row, system=asdict(system))
        a.crash = crash
        return crash

    def _shm_gib(self, a: AttemptWatch) -> float | None:
        return next((d["total_bytes"] / GIB for d in (a.row.system or {}).get("disks", [])
                     if d["role"] == "/dev/shm"), None)

    def _finish(self, a: AttemptWatch, crash: Crash, stopped: bool = False) -> None:
        self.observer.drain(a)
        a.finish(self.ctx.journal, self.host, crash, stopped=stopped)

    def _await_gone(self) -> None:
        """Before a relaunch: the watched trainer's processes gone (its workers too), up to wait_s + grace_s.
        They are not ours to stop: what is left is named, and the supervisor's GPU check decides."""
        s = self.recipe.supervisor
        deadline = self.host.monotonic() + s.wait_s + s.grace_s
        left = self.trainer.tree()
        while left and self.host.monotonic() < deadline:
            self.host.wait(self.stop_event, 0.2)
            left = [p for p in left if _exists(p)]
        if left:
            self.ctx.journal.event("take_over", f"processes of the watched trainer still run: {left}", pids=left)

    def _close(self, state: State) -> None:
        """Closes the watch as the supervisor's shutdown does: manifests, the final sync, the final record."""
        ctx = self.ctx
        if ctx.closed:
            return
        ctx.checkpoints.close()  # the manifests and content checks still running: what they find is advised
        if self.attempt is not None:
            self._advise_checkpoints(self.attempt)
        ctx.publisher.stop(final_sync=not self.poisoned)
        self.ticker.housekeeping(goodput_now=True)
        self.metrics.set_state(state)
        ctx.journal.put(state=state.value, exit_reason=self.exit_reason, updated_at=self.host.now(), watching=None)
        self.metrics.close()
        ctx.release()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def hand_off(recipe: Recipe, echo: Callable[[str], None] | None = None) -> ExitCode:
    """Takes the watched run over: a Supervisor of the same run (same journal; attempt numbers continue it)
    relaunches from the newest healthy checkpoint, as `run` would."""
    from orchestrator.loop.supervisor import Supervisor

    return Supervisor(recipe, echo=echo).run()

