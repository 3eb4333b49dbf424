"""HealthWatch: the one object the loop feeds, for every health detector over a run's logged steps and lines.

    watch = HealthWatch(recipe.health, recipe.checkpoint.resume_loss_tolerance, fp16_run(recipe))
    watch.attempt(resume_step, history, weights_only)   # at each launch
    for p in new step records: findings += watch.observe(p, now)   # now: when it was read (None: untimed)
    for a save or evaluation after step s: watch.paused(s)
    for line the parser did not understand: findings += watch.line(line, now)
    watch.alive_at                             # liveness from progress lines, parsed or not
    watch.loss_level                           # for orchestrator_loss_level
    watch.throughput                           # the attempt's throughput watch (ratio, baseline, slow spell)

The detectors are DETECTORS, in the order their findings come; each finding comes back once and
action.act says what to do about it. Pure: the caller gives the clock. Checkpoint content
(store/checkpoint_health.py) is judged apart: it reads the saved bytes, off the loop's thread.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from orchestrator.config.schema import HealthSection
from orchestrator.domain.health import loss, progress_unreadable, resume, skipped_steps, throughput
from orchestrator.domain.health.detector import Check, Detector, Snapshot, Start
from orchestrator.domain.health.kinds import Finding
from orchestrator.types import Progress

# Every detector over the step records and log lines. A new one: its module (a DETECTOR) and a line here.
DETECTORS: tuple[Detector, ...] = (
    loss.DETECTOR,
    skipped_steps.DETECTOR,
    resume.DETECTOR,
    progress_unreadable.DETECTOR,
    throughput.DETECTOR,
)


class HealthWatch:
    """A run's health: every detector of `detectors` over its step records and log lines, each made afresh for
    each attempt from where it resumes (`fp16`: the run has a loss scaler)."""

    def __init__(self, cfg: HealthSection, resume_loss_tolerance: float = 0.05, fp16: bool = False,
                 detectors: Sequence[Detector] = DETECTORS) -> None:
        self.cfg, self.resume_loss_tolerance, self.fp16 = cfg, resume_loss_tolerance, fp16
        self.detectors = tuple(detectors)
        self.logged: dict[int, Progress] = {}   # step -> the run's record of it (the latest attempt's)
        self.last_step: int | None = None
        self.checks: dict[str, Check] = {}
        self.baseline_s: float | None = None   # the fastest throughput baseline of earlier attempts
        self._start(Start(cfg, fp16=fp16, resume_loss_tolerance=resume_loss_tolerance))

    def _start(self, start: Start) -> None:
        self.checks = {d.name: d.fn(start) for d in self.detectors}
        self.on_step, self.on_timed, self.on_line = ([self.checks[d.name] for d in self.detectors
                                                      if d.requires == r] for r in ("step", "timed", "line"))

    def attempt(self, resume_step: int | None, history: Iterable[Progress] | None = None,
                weights_only: bool = False, suspect_from: int | None = None) -> None:
        """A new attempt starts from `resume_step` (None: from scratch; `weights_only`: Resume.weights_only, no
        optimizer state). `history`: the run's step records so far in the order they were logged (its
        logging.jsonl), where this watch did not see them itself (a supervisor restarted mid-run); a later record
        of a step replaces an earlier one. `suspect_from`: after a rollback, the onset step (HealthAction.
        quarantine_from): what was logged from there on is no reference for the redone steps."""
        if history is not None:
            self.logged = {}
            for p in history:
                self.logged[p.step] = p
        earlier = {s: p.loss for s, p in self.logged.items() if p.loss is not None and math.isfinite(p.loss)
                   and (suspect_from is None or s < suspect_from)}
        kept = [self.logged[s] for s in sorted(self.logged) if resume_step is not None and s <= resume_step]
        self.logged = {p.step: p for p in kept}
        ended = self.throughput   # the attempt before: its baseline is a reference for this one
        if ended is not None and ended.baseline_s is not None:
            self.baseline_s = min(self.baseline_s or ended.baseline_s, ended.baseline_s)
        self._start(Start(self.cfg, resume_step, kept, earlier, weights_only, self.fp16, self.resume_loss_tolerance,
                          self.baseline_s))
        self.last_step = resume_step

    def observe(self, p: Progress, now: float | None = None) -> list[Finding]:
        """The new findings of one step record read at `now` (None: no read time, the timed detectors are not
        fed); a step at or before the last one seen is a repeat (stdout and logging.jsonl both report each step)
        and brings no finding of the step detectors."""
        snap = Snapshot(record=p, now=now if now is not None else 0.0)
        found = [] if now is None else [f for check in self.on_timed for f in check(snap)]
        if self.last_step is not None and p.step <= self.last_step:
            return found
        self.last_step = p.step
        self.logged[p.step] = p
        return [f for check in self.on_step for f in check(snap)] + found

    def paused(self, step: int) -> None:
        """The trainer saved or evaluated after `step`: the timed detectors leave that gap out."""
        for check in self.on_timed:
            check(Snapshot(paused_after=step))

    def line(self, line: str, now: float, parsed: Progress | None = None) -> list[Finding]:
        """One log line and what the progress parser got from it (None: no step record)."""
        snap = Snapshot(line=line, parsed=parsed, now=now)
        return [f for check in self.on_line for f in check(snap)]

    @property
    def alive_at(self) -> float | None:
        """When the last line that looks like training progress came, understood or not (liveness)."""
        lines = self.checks.get(progress_unreadable.DETECTOR.name)
        return lines.alive_at if isinstance(lines, progress_unreadable.UnreadableTracker) else None

    @property
    def throughput(self) -> throughput.ThroughputTracker | None:
        """This attempt's throughput watch: its ratio now, its baseline, its open slow spell."""
        check = self.checks.get(throughput.DETECTOR.name)
        return check if isinstance(check, throughput.ThroughputTracker) else None

    @property
    def loss_level(self) -> float | None:
        """The loss level now: the median of the last health.divergence_window logged losses."""
        losses = self.checks.get(loss.DETECTOR.name)
        return losses.loss.level if isinstance(losses, loss.LossHealth) else None
