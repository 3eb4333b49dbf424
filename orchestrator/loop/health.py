"""Run health in the RUNNING pass: the loss and grad-norm detectors, the check of a resumed attempt against what
was logged before, progress lines the parser cannot read, and the attempt's throughput.

    start(a)         a new attempt: HealthWatch.attempt (the run's logged steps on this supervisor's first
                     launch; the throughput detector measures against the best baseline of earlier attempts)
    observe(a, ...)  feeds what the pass read to the detectors (domain/health/: the HealthWatch's list) and
                     takes the machine's evidence at a throughput drop -> HealthSeen, the
                     findings as facts with the Situation deciding them needs (a frozen value for the Observation)
    decide(seen)     pure: each finding's action (domain/health/action.act), folded into what judge reads
                     (loop/running.py decides them together with the pass's other outcomes)
    record(events)   the journal events (with their numbers and the action taken), the metrics, the `slow`
                     spans: called by the supervisor where it acts, after judge
    end(now)         the slow spell still open when the attempt ends, as a `slow` span
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from orchestrator.domain import progress
from orchestrator.domain.health import action
from orchestrator.domain.health.action import HealthAction, Situation, rollbacks_of
from orchestrator.domain.health.kinds import DIVERGENCE_KINDS, Finding
from orchestrator.domain.health.skipped_steps import fp16_run
from orchestrator.domain.health.slowdown_clues import clues
from orchestrator.domain.health.throughput import ThroughputTracker
from orchestrator.domain.health.watch import HealthWatch
from orchestrator.host.base import Host
from orchestrator.host.metrics import Metrics
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.run import RunContext
from orchestrator.types import Alert, AttemptKind, HealthKind, Progress

SUSPECT_KEY = "health_suspect"   # journal kv: {"from", "through"}: steps whose logged losses are no reference


@dataclass(frozen=True)
class HealthEvent:
    """One health event to record: its kind, message and numbers (with the action taken about it)."""

    kind: str
    message: str
    data: dict = field(default_factory=dict)
    slow_span: tuple[float, float] | None = None   # throughput_recovered: the slow spell, for goodput


@dataclass(frozen=True)
class Found:
    """One finding of a pass, with what observing it added: the machine's evidence at a throughput_drop."""

    finding: Finding
    note: str = ""                                  # appended to its event's message (the slowdown's clues)
    data: dict = field(default_factory=dict)        # more numbers for its event (clues, evidence)


@dataclass(frozen=True)
class HealthSeen:
    """What one pass's health detectors found, as facts, and what deciding them needs (nothing decided yet)."""

    found: tuple[Found, ...] = ()
    situation: Situation = Situation()


@dataclass(frozen=True)
class HealthCalls:
    """What a pass's findings call for: each one's action (in `found` order), and the strongest of them."""

    acts: tuple[HealthAction, ...] = ()
    stop: str | None = None                  # a graceful stop, exit 3 with this reason
    rollback: HealthAction | None = None     # quarantine from .quarantine_from, relaunch from .relaunch_from
    resume_suspect: bool = False             # the rollback is a resume divergence's (relaunch once, then stop)
    restart: str | None = None               # health.on_slowdown = "restart": a graceful stop and a relaunch
    restart_by: int | None = None            # ... called for by this finding (its index in `found`)
    onset: int | None = None                 # the earliest step a stop or rollback finding names: checkpoints
                                             # from here on are not healthy, whatever verdict wins the pass


def decide(seen: HealthSeen) -> HealthCalls:
    """Decides each finding of a pass (action.act under its Situation) and folds the actions: the first stop, the
    first rollback, the first restart, the earliest onset. Pure."""
    acts = tuple(action.act(fd.finding, seen.situation) for fd in seen.found)
    stop, rollback, suspect, restart, restart_by, onsets = None, None, False, None, None, []
    for i, (fd, act) in enumerate(zip(seen.found, acts)):
        f = fd.finding
        if act.action in ("stop", "rollback"):
            onsets.append(act.quarantine_from if act.quarantine_from is not None else f.first_step
                          if f.first_step is not None else f.last_step if f.kind in DIVERGENCE_KINDS else None)
        if act.action == "stop" and stop is None:
            stop = f"resume divergence: {act.reason}" if f.kind == HealthKind.RESUME_DIVERGENCE else act.reason
        elif act.action == "rollback" and rollback is None:
            rollback, suspect = act, f.kind == HealthKind.RESUME_DIVERGENCE
        elif act.action == "restart" and restart is None:
            restart, restart_by = f"{f.message}; restarting ({act.reason})", i
    return HealthCalls(acts, stop, rollback, suspect, restart, restart_by,
                       min((o for o in onsets if o is not None), default=None))


class RunHealth:
    def __init__(self, ctx: RunContext, host: Host, metrics: Metrics):
        self.ctx, self.cfg, self.host, self.metrics = ctx, ctx.recipe.health, host, metrics
        self.watch = HealthWatch(self.cfg, ctx.recipe.checkpoint.resume_loss_tolerance, fp16_run(ctx.recipe))
        self.training = False                   # the attempt trains (an export does not: no detectors)
        self.suspect_from: int | None = None    # after a set-aside: what was logged from here is no reference
        self.retrying_resume = False            # this attempt is the relaunch after a suspect resume checkpoint
        self.next_is_retry = False              # ... and the next one will be
        self.last_restart_at: float | None = None
        self.suspect_through: int | None = None  # the journal's suspect steps end here (until redone)
        self.history_read = False

    def start(self, a: AttemptWatch) -> None:
        """A new attempt: the detectors learn where it resumes from (an export trains nothing: no detectors)."""
        self.training = a.row.kind != AttemptKind.EXPORT
        if not self.training:
            return
        history = None if self.history_read else self._logged()
        self.history_read = True
        resume = a.resume
        suspect = self.suspect_from
        recorded = self.ctx.journal.get_all().get(SUSPECT_KEY) or {}
        self.suspect_through = recorded.get("through")
        if suspect is None and history is not None:  # a restarted supervisor: the set-aside its predecessor made
            suspect = recorded.get("from")
        self.watch.attempt(resume.step if resume else None, history, resume.weights_only if resume else False,
                           suspect_from=suspect)
        self.suspect_from = None
        self.retrying_resume, self.next_is_retry = self.next_is_retry, False

    @property
    def throughput(self) -> ThroughputTracker | None:
        """The training attempt's throughput watch (the HealthWatch's throughput detector)."""
        return self.watch.throughput if self.training else None

    @property
    def alive_mono(self) -> float | None:
        """When the last line that looks like training progress came (monotonic), understood or not."""
        return self.watch.alive_at

    def observe(self, a: AttemptWatch, fresh: list[Progress], now: float, mono: float) -> HealthSeen:
        """Feeds one pass's reading to the detectors; returns what they found (facts: nothing is decided here) and
        the Situation deciding it needs, with the machine's evidence at a throughput drop."""
        lines, saves = a.take_read()
        if self.throughput is None:
            return HealthSeen()
        found = [f for line, parsed in lines for f in self.watch.line(line, mono, parsed)]
        for step in saves:
            self.watch.paused(step)
        found += [f for p in fresh for f in self.watch.observe(p, now)]
        self.metrics.loss_level(self.watch.loss_level)
        if self.throughput.ratio is not None:
            self.metrics.throughput(self.throughput.ratio)
        situation = Situation(
            self.cfg.on_divergence, self.cfg.on_slowdown, tuple(self.ctx.checkpoints.good_steps()) if found else (),
            tuple(rollbacks_of(self.ctx.journal.events_of(DIVERGENCE_KINDS)))
            if any(f.kind in DIVERGENCE_KINDS for f in found) else (),
            a.resume.step if a.resume is not None else None, self.retrying_resume, now, self.last_restart_at)
        self._forget_suspect(a)
        return HealthSeen(tuple(self._evidence(a, f) for f in found), situation)

    def _evidence(self, a: AttemptWatch, f: Finding) -> Found:
        """A finding with the machine's evidence at a throughput drop (what else was busy, I/O), for its event."""
        if f.kind != HealthKind.THROUGHPUT_DROP:
            return Found(f)
        evidence = self.host.slowdown_evidence(a.launched)
        suspects = clues(evidence)
        return Found(f, f"; {'; '.join(suspects)}" if suspects else "",
                     {"clues": list(suspects), "evidence": asdict(evidence)})

    def record(self, events: tuple[HealthEvent, ...]) -> None:
        """Records a pass's health events (running.judge_pass's, with the action taken): journal (with their
        numbers), metrics, the `slow` goodput spans."""
        for e in events:
            self.ctx.journal.event(e.kind, e.message, **e.data)
            self.metrics.health_event(e.kind)   # with what KINDS says it raises (resume_divergence: its counter)
            if e.slow_span:
                self.ctx.journal.span(*e.slow_span, "slow")

    def restarted(self, now: float) -> None:
        """A SlowRestart was carried out (or, in watch mode, advised) at `now`: on_slowdown restarts at most once
        per action.RESTART_MIN_GAP_S from here."""
        self.last_restart_at = now

    def set_aside_from(self, step: int, through: int | None, resume_suspect: bool = False) -> None:
        """Checkpoints from `step` on were set aside (a rollback, a NaN, a stop): the next attempt's resume check
        ignores what was logged from there to `through` (the last step the attempt logged; kept in the journal
        until those steps are redone, for a restarted supervisor), and a resume divergence's relaunch is its
        one retry."""
        self.suspect_from = step if self.suspect_from is None else min(self.suspect_from, step)
        self.next_is_retry = resume_suspect
        self.ctx.journal.put(**{SUSPECT_KEY: {"from": self.suspect_from, "through": max(step, through or step)}})

    def _forget_suspect(self, a: AttemptWatch) -> None:
        """Once an attempt has redone every step a set-aside made suspect, the journal's record of it goes."""
        if self.suspect_through is not None and a.last is not None and a.last.step > self.suspect_through:
            self.suspect_through = None
            self.ctx.journal.put(**{SUSPECT_KEY: None})

    def end(self, now: float) -> None:
        """The attempt ended: a slow spell still open is recorded as a `slow` span (once), its throughput_drop
        alert cleared."""
        if self.throughput and (spell := self.throughput.close_spell(now)):
            self.ctx.journal.span(*spell, "slow")
        self.metrics.alert(Alert.THROUGHPUT_DROP, False)  # judged against the attempt's own baseline: it ends here

    def _logged(self) -> list[Progress]:
        """The run's step records so far, from its logging.jsonl (a supervisor restarted mid-run)."""
        try:
            lines = (self.ctx.out / "logging.jsonl").read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [p for p in map(progress.parse_jsonl_line, lines) if p is not None]
