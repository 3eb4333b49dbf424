"""HealthWatch: the one object the loop feeds, for every health detector over a run's logged steps and lines.

    watch = HealthWatch(recipe.health, recipe.checkpoint.resume_loss_tolerance, fp16_run(recipe))
    watch.attempt(resume_step, history, weights_only)   # at each launch
    for p in new step records: findings += watch.observe(p)
    for line the parser did not understand: findings += watch.line(line, now)
    watch.alive_at                             # liveness from progress lines, parsed or not
    watch.loss_level                           # for orchestrator_loss_level

Each finding comes back once; health_action.decide says what to do about it. Pure: the caller gives the clock.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from orchestrator.domain.health.kinds import Finding
from orchestrator.config.schema import HealthSection
from orchestrator.domain.health.loss import LossHealth
from orchestrator.domain.health.resume import ResumeCheck
from orchestrator.domain.health.progress_unreadable import UnreadableTracker
from orchestrator.domain.health.skipped_steps import SkippedSteps
from orchestrator.types import Progress, HealthKind


class HealthWatch:
    """A run's health: the loss and grad-norm detectors over its step records, the resumed attempt's check
    against what was logged before, the progress lines the parser did not understand, and (`fp16`: the run has
    a loss scaler) the updates it skipped."""

    def __init__(self, cfg: HealthSection, resume_loss_tolerance: float = 0.05, fp16: bool = False) -> None:
        self.cfg, self.resume_loss_tolerance, self.fp16 = cfg, resume_loss_tolerance, fp16
        self.skips = SkippedSteps(fp16, cfg.max_skipped_steps)
        self.losses = LossHealth(cfg)
        self.logged: dict[int, Progress] = {}   # step -> the run's record of it (the latest attempt's)
        self.resume: ResumeCheck | None = None
        self.lines = UnreadableTracker(cfg.unreadable_lines)
        self.last_step: int | None = None

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
        self.losses.replay(kept)
        self.resume = (ResumeCheck(resume_step, earlier, self.cfg, self.resume_loss_tolerance, weights_only)
                       if resume_step is not None else None)
        self.lines = UnreadableTracker(self.cfg.unreadable_lines)
        self.last_step = resume_step
        self.skips = SkippedSteps(self.fp16, self.cfg.max_skipped_steps, resume_step or 0)

    def observe(self, p: Progress) -> list[Finding]:
        """The new findings of one step record; a step at or before the last one seen is a repeat (stdout and
        logging.jsonl both report each step) and brings none."""
        if self.last_step is not None and p.step <= self.last_step:
            return []
        self.last_step = p.step
        self.logged[p.step] = p
        found = self.losses.observe(p) + self._skipped(p)
        if self.resume is not None:
            f = self.resume.observe(p)
            found += [f] if f is not None else []
        return found

    def _skipped(self, p: Progress) -> list[Finding]:
        """A `skipped_steps` warning where a run of skipped updates starts (the metrics count every one; the NaN
        andon of a run that persists is the attempt's, loop/attempt.py)."""
        check = self.skips.observe(p)
        if not check.skipped or check.run != check.skipped or check.andon:
            return []
        why = (f"the trainer reports {check.skipped} skipped" if p.skipped else
               f"grad norm {p.grad_norm} with a finite loss {p.loss} in an fp16 run")
        return [Finding(HealthKind.SKIPPED_STEPS, f"step {p.step}: an overflow-skipped update ({why}): the loss scaler skips "
                                       "the update and lowers its scale; NaN only after more than "
                                       f"health.max_skipped_steps ({self.cfg.max_skipped_steps}) in a row",
                        p.step, p.step, value=p.grad_norm if p.grad_norm is not None else None,
                        details={"skipped": check.skipped, "skipped_total": self.skips.total})]

    def line(self, line: str, now: float, parsed: Progress | None = None) -> list[Finding]:
        """One log line and what the progress parser got from it (None: no step record)."""
        f = self.lines.feed(line, now, parsed)
        return [f] if f is not None else []

    @property
    def alive_at(self) -> float | None:
        """When the last line that looks like training progress came, understood or not (liveness)."""
        return self.lines.alive_at

    @property
    def loss_level(self) -> float | None:
        """The loss level now: the median of the last health.divergence_window logged losses."""
        return self.losses.loss.level
