"""RUNNING, one pass: observe -> judge -> act.

    observe(a)  I/O only: wait for the poll interval (or the exit), read the new step records, scan and verify
                checkpoints, keep space, the per-pass housekeeping, drain an exited trainer, the resume check,
                the hang timer. Returns an Observation: a frozen value of everything a verdict depends on.
    judge(obs)  pure: the one Verdict of this pass. Its precedence is the order below, table-tested
                (tests/test_judge.py):
                  a NaN/Inf seen             -> Crashed (nan_loss), also when the trainer exited after it; it
                                                sets aside from the NaN or the earliest health onset, if earlier
                  the export exited          -> ExportExited
                  run health calls for a stop     -> HealthStop (also when the trainer exited, or completed: no
                                                     relaunch into a divergence, no export past its onset)
                  run health calls for a rollback -> RolledBack
                  every step done, the last checkpoint verified, a nonzero exit at teardown -> TrainingOver
                  every step done, exit 0    -> TrainingOver, or Crashed (other) when the last save is torn
                  any other exit             -> Crashed (classify the log)
                  a stop requested           -> StopRequested
                  disk about to fill         -> Crashed (disk_full)
                  resumed at the wrong step  -> ResumedAtWrongStep
                  a slowdown, on_slowdown = "restart" -> SlowRestart
                  hang                       -> Crashed (nccl_timeout_hang, stacks dumped)
                  otherwise                  -> Keep
                Run health's findings come as facts (HealthSeen); judge decides them (loop/health.decide: the
                pure action.act of each) together with the outcomes above.
    judge_pass  pure: judge's verdict, and the pass's health events to record, each saying what was done about
                its finding (health_events below): warnings are recorded whatever the verdict.
    act         the supervisor (loop/supervisor.py `_running`) records the events and carries the verdict out.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.domain import policy
from orchestrator.host.base import Host
from orchestrator.host.metrics import Metrics
from orchestrator.domain.health.action import HealthAction, newest_before
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.health import HealthCalls, HealthEvent, HealthSeen, RunHealth, decide
from orchestrator.loop.run import RunContext
from orchestrator.loop.ticker import Ticker
from orchestrator.types import AttemptKind, Crash, CrashClass, ExitStatus, HealthKind, Phase, Progress

CHECKPOINT_SCAN_S = 2.0
ECHO_PROGRESS_S = 10.0


@dataclass(frozen=True)
class Observation:
    """What one RUNNING pass saw of the attempt and the run."""

    now: float
    exit: ExitStatus | None            # None: the trainer still runs
    kind: AttemptKind
    phase: Phase
    nan_line: tuple[str, ...] = ()     # the NaN/Inf line, once seen
    nan_step: int | None = None
    at_end: bool = False               # the trainer logged its last step, or wrote its closing record
    last_step: int | None = None
    last_verified: bool = False        # the last step's checkpoint verified
    last_torn: tuple[str, ...] = ()    # why the last step's checkpoint failed verification
    stop_requested: bool = False
    disk_full: str | None = None       # why the trainer must stop before it meets ENOSPC
    resumed_at_wrong_step: str | None = None   # the resumed trainer did not continue from its checkpoint
    hang: str | None = None
    health: HealthSeen = HealthSeen()


@dataclass(frozen=True)
class Keep:
    """Nothing to do: the next pass."""


@dataclass(frozen=True)
class Crashed:
    """The attempt failed. `crash`: what the loop saw itself; None: classify its log."""

    crash: Crash | None = None
    nan_step: int | None = None        # a NaN: recorded as pending before anything else, for a successor
    hang: bool = False                 # dump the trainer's stacks first
    set_aside_from: int | None = None  # checkpoints from here on are set aside (the NaN, or an earlier onset)


@dataclass(frozen=True)
class TrainingOver:
    """Every step is done. `teardown_failure`: the nonzero exit after the verified last save, to record."""

    teardown_failure: str | None = None


@dataclass(frozen=True)
class ExportExited:
    """The export attempt exited: its output decides."""


@dataclass(frozen=True)
class StopRequested:
    """The operator (a signal) or a spot notice asked to stop."""


@dataclass(frozen=True)
class ResumedAtWrongStep:
    """The resumed attempt did not continue from its resume point: give up, saying why."""

    detail: str


@dataclass(frozen=True)
class HealthStop:
    """Run health calls for a stop (health.on_divergence = "stop", a recurrence, a broken resume path): a
    graceful stop, checkpoints kept, exit 3 with the reason."""

    reason: str
    set_aside_from: int | None = None  # a divergence's onset: checkpoints from here on are not healthy


@dataclass(frozen=True)
class RolledBack:
    """Run health calls for a rollback: a graceful stop, the checkpoints from the onset on quarantined, a
    relaunch from the newest verified one before it."""

    action: HealthAction
    resume_suspect: bool = False
    set_aside_from: int | None = None  # the earliest onset of the pass (the action's, or an earlier finding's)


@dataclass(frozen=True)
class SlowRestart:
    """The attempt trains slower than its baseline and health.on_slowdown = "restart": a graceful stop and a
    relaunch."""

    reason: str


Verdict = (Keep | Crashed | TrainingOver | ExportExited | StopRequested | ResumedAtWrongStep | HealthStop | RolledBack
           | SlowRestart)


@dataclass(frozen=True)
class Judgement:
    """A pass judged: its one verdict, and the health events to record (each with the action taken)."""

    verdict: Verdict
    events: tuple[HealthEvent, ...] = ()


def judge_pass(obs: Observation) -> Judgement:
    """Judges a RUNNING pass: its verdict (judge) and its health events, each saying what was done. Pure."""
    calls = decide(obs.health)
    verdict = _verdict(obs, calls)
    return Judgement(verdict, health_events(obs.health, calls, verdict))


def judge(obs: Observation) -> Verdict:
    """Returns the one verdict of a RUNNING pass; the precedence is the module docstring's table. Pure."""
    return _verdict(obs, decide(obs.health))


def _verdict(obs: Observation, health: HealthCalls) -> Verdict:
    """The verdict of judge, given the pass's health findings decided."""
    onset = health.onset
    if obs.nan_line:
        first = min((s for s in (obs.nan_step, onset) if s is not None), default=None)
        return Crashed(Crash(CrashClass.NAN_LOSS, obs.nan_line, Phase.TRAINING), nan_step=obs.nan_step,
                       set_aside_from=first)
    if obs.exit is not None and obs.kind == AttemptKind.EXPORT:
        return ExportExited()
    if health.stop:
        return HealthStop(health.stop, onset)
    if health.rollback:
        first = min((s for s in (health.rollback.quarantine_from, onset) if s is not None), default=None)
        return RolledBack(health.rollback, health.resume_suspect, first)
    if obs.exit is not None:
        if obs.at_end and obs.exit.code != 0 and obs.last_verified:
            # every step done and the last save verified: a failure while tearing down (seen: a gloo rank's
            # "terminate called without an active exception" at exit) leaves nothing to redo
            how = obs.exit.code if obs.exit.code is not None else f"by signal {obs.exit.signal}"
            return TrainingOver(f"the trainer exited {how} after its last step {obs.last_step}, whose checkpoint "
                                "verified: training is complete")
        if obs.at_end and obs.exit.code == 0:
            if obs.last_torn:  # not complete: the newest verified checkpoint is older than the last step
                return Crashed(Crash(CrashClass.OTHER, (
                    f"the trainer exited 0 at step {obs.last_step} but its final checkpoint failed verification: "
                    "not complete; find why the save broke, then rerun to redo the steps after the newest "
                    "verified checkpoint",) + obs.last_torn, Phase.TRAINING))
            return TrainingOver()
        return Crashed()
    if obs.stop_requested:
        return StopRequested()
    if obs.disk_full:
        return Crashed(Crash(CrashClass.DISK_FULL, (obs.disk_full,), obs.phase))
    if obs.resumed_at_wrong_step:
        return ResumedAtWrongStep(obs.resumed_at_wrong_step)
    if health.restart:
        return SlowRestart(health.restart)
    if obs.hang:
        return Crashed(Crash(CrashClass.NCCL_TIMEOUT_HANG, (obs.hang,), obs.phase), hang=True)
    return Keep()


def taken(v: Verdict) -> str:
    """The verdict's name in the journal (a health event's `taken`): crashed:<class>, health_stop, rolled_back ..."""
    if isinstance(v, Crashed):
        return f"crashed:{v.crash.cls.value}" if v.crash else "crashed"
    return _TAKEN[type(v)]


_TAKEN: dict[type, str] = {Keep: "keep", TrainingOver: "training_over", ExportExited: "export_exited",
                           StopRequested: "stop_requested", ResumedAtWrongStep: "resumed_at_wrong_step",
                           HealthStop: "health_stop", RolledBack: "rolled_back", SlowRestart: "slow_restart"}


def carried_out(act: HealthAction, i: int, calls: HealthCalls, v: Verdict, verified: Sequence[int]) -> bool:
    """Whether verdict `v` does what act() proposed for the pass's finding `i`. A warning always is (it is the
    event); a stop when the run stops; a restart when it is this finding's; a rollback when the verdict sets
    aside from its onset or earlier and relaunches from the same checkpoint: its own RolledBack, another
    finding's that does the same, or a NaN crash (which relaunches from the newest verified checkpoint before
    what it set aside): for the recurrence rule (action.rollbacks_of) that is the rollback."""
    match act.action:
        case "warn":
            return True
        case "stop":
            return isinstance(v, HealthStop)
        case "restart":
            return isinstance(v, SlowRestart) and calls.restart_by == i
    if act.quarantine_from is None:
        return False
    if isinstance(v, RolledBack):
        done = v.action
        return (done == act or done.quarantine_from is not None and done.quarantine_from <= act.quarantine_from
                and done.relaunch_from == act.relaunch_from)
    if isinstance(v, Crashed) and v.set_aside_from is not None:
        return (v.set_aside_from <= act.quarantine_from
                and newest_before(v.set_aside_from, verified) == act.relaunch_from)
    return False


def health_events(seen: HealthSeen, calls: HealthCalls, v: Verdict) -> tuple[HealthEvent, ...]:
    """The pass's health events, each with the action taken about its finding and `taken`, the verdict carried
    out. A finding the verdict did not carry out says `action: "superseded"` and what act() `proposed`; a stop
    or rollback finding says where the verdict set aside from (`set_aside_from`), when it did. Pure."""
    out = []
    first = v.set_aside_from if isinstance(v, (Crashed, HealthStop)) else (
        v.action.quarantine_from if isinstance(v, RolledBack) else None)
    for i, (fd, act) in enumerate(zip(seen.found, calls.acts)):
        f = fd.finding
        data = {**f.record(), **act.record(), **fd.data}
        if f.kind == HealthKind.THROUGHPUT_DROP:
            data["why"] = act.reason
        if not carried_out(act, i, calls, v, seen.situation.verified_steps):
            data |= {"action": "superseded", "proposed": act.action}
        if act.action in ("stop", "rollback") and first is not None:
            data["set_aside_from"] = first
        data["taken"] = taken(v)
        out.append(HealthEvent(f.kind, f.message + fd.note, data, slow_span=(f.since, f.at)
                               if f.kind == HealthKind.THROUGHPUT_RECOVERED and f.since is not None
                               and f.at is not None else None))
    return tuple(out)


class Observer:
    """Observes the running attempt, one pass at a time (the I/O half of RUNNING)."""

    def __init__(self, ctx: RunContext, host: Host, metrics: Metrics, ticker: Ticker, health: RunHealth,
                 stop_requested: Callable[[], bool], echo: Callable[[str], None] | None = None):
        self.ctx, self.recipe, self.host, self.metrics, self.ticker = ctx, ctx.recipe, host, metrics, ticker
        self.health, self.stop_requested, self.echo = health, stop_requested, echo
        self.echoed_at = self.scanned_at = float("-inf")  # monotonic times of the last progress line and scan

    def observe(self, a: AttemptWatch) -> Observation:
        """Waits one poll interval (or for the exit) and returns what the pass saw."""
        self.host.wait_exit(a.launched, self.recipe.supervisor.poll_s)  # wakes at once on exit
        now, mono = self.host.now(), self.host.monotonic()
        fresh = a.gather(now, mono)
        for p in fresh:
            self.metrics.observe_progress(p, a.skipped.get(p.step, 0))
        self._echo_progress(a, now, mono)
        disk_full = self.keep_space(a) if self.scan() else None
        self.ticker.housekeeping()
        exit_ = a.launched.status
        if exit_ is not None:
            fresh += self.drain(a)  # everything it wrote before exiting, however much
        health = self.health.observe(a, fresh, now, mono)
        last = a.last.step if a.last else None
        verified: bool = False
        torn: tuple[str, ...] = ()
        if exit_ is not None and a.at_end and last is not None:  # how the last step's checkpoint fared
            verified, torn = self.ctx.checkpoints.verified_at(last), tuple(self.ctx.checkpoints.failed_at(last))
        return Observation(
            now=now, exit=exit_, kind=a.row.kind, phase=a.phase, nan_line=a.bad, nan_step=a.bad_step,
            at_end=a.at_end, last_step=last, last_verified=verified, last_torn=torn,
            stop_requested=self.stop_requested(), disk_full=disk_full,
            resumed_at_wrong_step=self._resumed_at_wrong_step(a) if exit_ is None else None, health=health,
            hang=self._hang(a, now, mono) if exit_ is None else None)

    def drain(self, a: AttemptWatch) -> list[Progress]:
        """Reads everything an exited trainer wrote (log, logging.jsonl, checkpoints) before it is recorded;
        returns the step records it read."""
        fresh = a.gather(self.host.now(), self.host.monotonic(), drain=True)
        for p in fresh:
            self.metrics.observe_progress(p, a.skipped.get(p.step, 0))
        self.scan(force=True)
        return fresh

    def scan(self, force: bool = False) -> bool:
        """Scans and verifies new checkpoints, at most every CHECKPOINT_SCAN_S unless forced; True when it did."""
        mono = self.host.monotonic()
        if not force and mono - self.scanned_at < CHECKPOINT_SCAN_S:
            return False
        self.scanned_at = mono
        self.ctx.checkpoints.scan(self.host.now())
        self.ctx.checkpoints.retry_manifests()
        return True

    def keep_space(self, a: AttemptWatch) -> str | None:
        """Applies local retention, and under disk pressure (less free than the next save needs) prunes down to
        the resume point and what is not yet published. Returns why the trainer must stop when even that leaves
        less than min(next save, min_free_gib): it would meet ENOSPC mid-save."""
        out, min_free = self.recipe.run.output_dir, self.recipe.supervisor.min_free_gib
        need = self.ctx.save_gib or min_free
        free = self.host.free_gib(out)
        if self.ctx.checkpoints.prune(self.ctx.keep_local, pressure=free < need, trusted_through=a.clean_through):
            free = self.host.free_gib(out)
        if free < min(need, min_free):
            return (f"{out}: {free:.3g} GiB free, the next save needs ~{need:.3g} GiB and nothing more can be "
                    "pruned: stopped before the trainer meets ENOSPC")
        return None

    def _echo_progress(self, a: AttemptWatch, now: float, mono: float) -> None:
        if self.echo and a.last and mono - self.echoed_at >= ECHO_PROGRESS_S:
            self.echoed_at = mono
            loss = f" loss {a.last.loss:.4g}" if a.last.loss is not None else ""
            self.echo(f"{time.strftime('%H:%M:%S', time.localtime(now))} progress: "
                      f"step {a.last.step}/{a.last.max_steps}{loss}")

    def _resumed_at_wrong_step(self, a: AttemptWatch) -> str | None:
        """Checks the resumed attempt's first logged step follows its resume point (once). Its losses against the
        run's earlier ones are run health's resume check (loop/health.py)."""
        if a.resume is None or a.first_logged is None or a.resume_checked:
            return None
        a.resume_checked = True
        return policy.resume_verdict(a.resume.step, a.first_logged.step, self.recipe.checkpoint.logging_steps)

    def _hang(self, a: AttemptWatch, now: float, mono: float) -> str | None:
        """No new step within the attempt's hang timer (policy.hang_timeout), and no save in progress: at 397B a
        merged copy takes half an hour to write, and no step is logged meanwhile."""
        s = self.recipe.supervisor
        timer, why = policy.hang_timeout(s, a.longest_gap_s, a.gaps, len(a.saves),
                                         evals_apart="eval_steps" in self.recipe.extra_args)
        if timer != a.hang_timer_s:
            if a.hang_timer_s is None or a.hang_timer_s >= s.hang_timeout_s > timer:
                self.ctx.journal.event("hang_timer", f"attempt {a.n}: hang timer {timer:.0f} s: {why}", seconds=timer)
            a.hang_timer_s = timer
            self.metrics.hang_timer(timer)
        # progress lines the parser cannot read still show the trainer alive (progress_unreadable)
        alive = max((t for t in (a.last_step_mono, self.health.alive_mono) if t is not None), default=None)
        hang = policy.hang_verdict(mono, a.launched.started_mono, alive, timer, s.startup_timeout_s)
        if hang and a.row.kind == AttemptKind.EXPORT:
            return (f"the export still runs after startup_timeout_s = {s.startup_timeout_s:.0f} s (an export logs "
                    f"no steps: startup_timeout_s bounds it; raise it for a model this size)")
        last = self.host.newest_write(self.ctx.out) if hang else None
        if not hang or (last is not None and now - last < timer):
            return None
        return hang if alive is None else f"{hang}: {why}"
