"""Divergence after a resume, with or without redone steps (issue 23, item 2). Pure.

Two checks on a resumed attempt, against what the run logged before:
  redone steps   every step the earlier attempt logged past the resume point is redone from the same weights
                 and data: its loss must match the earlier one within checkpoint.resume_loss_tolerance (after a
                 weights-only resume only the first: the optimizer starts afresh)
  resume point   the level right at the resume point, on both sides: the first EDGE logged losses after it
                 against the level the window before reaches at it (the larger of the median of its last EDGE
                 losses and its robust trend line at its end), by more than health.resume_level_tolerance (and
                 health.divergence_min_rise, and 3 x the window's noise around its trend). Early in a
                 fine-tune the loss falls fast: a window's median sits far above the level at its end, and a
                 jump from the level at the save (0.91 -> 1.57) hides under it.
  first window   the first health.resume_window logged losses after the resume against as many before the
                 resume point: their median may not rise by more than health.resume_level_tolerance (and
                 health.divergence_min_rise). A jump that builds up over the first steps.
Both compare nothing redone: a crash right after a save, then a resume from wrong weights that verified.
Any one -> resume_divergence (the supervisor's existing event name), once per attempt.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from orchestrator.domain.health.detector import Check, Detector, Snapshot, Start
from orchestrator.domain.health.kinds import Finding
from orchestrator.config.schema import HealthSection
from orchestrator.domain.health.loss import divergence_threshold
from orchestrator.types import HealthKind, Progress

MIN_WINDOW = 3   # fewer losses on either side of the resume point say nothing about a level
EDGE = 3         # logged losses on each side that make the level at the resume point (a median of 3 drops one
                 # outlier, and a wrong-weights jump shows on the first steps, before training pulls it back)
NOISE_Z = 3.0    # the edge levels are medians of 3: a jump must clear 3 x the per-step noise around the trend


def redone_mismatch(loss: float, earlier: float, tolerance: float) -> bool:
    """Whether a redone step's loss differs from the loss logged at that step before by more than
    `tolerance`, relative to the earlier loss."""
    return abs(loss - earlier) / max(abs(earlier), 1e-8) > tolerance


def window_jump(before: Sequence[float], after: Sequence[float], tolerance: float,
                min_rise: float) -> tuple[float, float, float] | None:
    """(level before, level after, threshold) when the median of `after` is above the threshold over the
    median of `before`; None when it is not, or when either side has fewer than MIN_WINDOW losses."""
    if len(before) < MIN_WINDOW or len(after) < MIN_WINDOW:
        return None
    level_before, level_after = statistics.median(before), statistics.median(after)
    threshold = divergence_threshold(level_before, tolerance, min_rise)
    return (level_before, level_after, threshold) if level_after > threshold else None


def trend_at_end(steps: Sequence[int], values: Sequence[float]) -> tuple[float, float]:
    """(value, noise): the robust (Theil-Sen) line through (steps, values) at the last step, and the scaled
    median absolute deviation of the values around that line (1.4826 x MAD: a standard deviation for Gaussian
    noise)."""
    pairs = [(values[j] - values[i]) / (steps[j] - steps[i])
             for i in range(len(steps)) for j in range(i + 1, len(steps)) if steps[j] != steps[i]]
    slope = statistics.median(pairs) if pairs else 0.0
    intercept = statistics.median(v - slope * s for s, v in zip(steps, values, strict=True))
    residuals = [v - (intercept + slope * s) for s, v in zip(steps, values, strict=True)]
    return intercept + slope * steps[-1], 1.4826 * statistics.median(abs(r) for r in residuals)


def edge_jump(before_steps: Sequence[int], before: Sequence[float], after: Sequence[float], tolerance: float,
              min_rise: float) -> tuple[float, float, float] | None:
    """(level at the resume point, level right after it, threshold) when the first EDGE losses after the resume
    point sit above the threshold over the level the window before reaches at it; None when not, or when
    either side is too short. The level before is the larger of the median of its last EDGE losses and its
    trend line's end (a lower estimate would call noise a jump); the threshold adds the window's noise."""
    if len(before) < MIN_WINDOW or len(after) < EDGE:
        return None
    at_end, noise = trend_at_end(before_steps, before)
    level = max(statistics.median(before[-EDGE:]), at_end)
    after_level = statistics.median(after[:EDGE])
    threshold = level + max(tolerance * abs(level), min_rise, NOISE_Z * noise)
    return (level, after_level, threshold) if after_level > threshold else None


class ResumeCheck:
    """One resumed attempt. `earlier`: step -> loss as the run logged it before this attempt (the latest
    attempt's value where several logged a step)."""

    def __init__(self, resume_step: int, earlier: Mapping[int, float], cfg: HealthSection,
                 resume_loss_tolerance: float, weights_only: bool = False) -> None:
        self.resume_step, self.cfg, self.tolerance = resume_step, cfg, resume_loss_tolerance
        self.redone = {s: v for s, v in earlier.items() if s > resume_step}
        if weights_only and self.redone:
            # no optimizer state: only the first redone step runs on the same weights as before (its loss is taken
            # before its update); every later one follows a fresh optimizer's update and may differ
            first = min(self.redone)
            self.redone = {first: self.redone[first]}
        before = [s for s in sorted(earlier) if s <= resume_step][-cfg.resume_window:]
        self.before_steps = before
        self.before = [earlier[s] for s in before]
        self.after: list[float] = []
        self.compared = 0     # redone steps compared so far
        self.window_checked = False
        self.done = False     # found, or both checks passed

    def observe(self, p: Progress) -> Finding | None:
        """One new step record of the resumed attempt (step order; repeats already dropped)."""
        if self.done or p.loss is None or not math.isfinite(p.loss) or p.step <= self.resume_step:
            return None
        earlier = self.redone.get(p.step)
        if earlier is not None:
            self.compared += 1
            if redone_mismatch(p.loss, earlier, self.tolerance):
                self.done = True
                return Finding(HealthKind.RESUME_DIVERGENCE,
                               f"resumed from step {self.resume_step}: the redone step {p.step} logged loss "
                               f"{p.loss:.6g}, the earlier attempt {earlier:.6g} (tolerance "
                               f"{self.tolerance:.0%}, checkpoint.resume_loss_tolerance)",
                               p.step, p.step, None, earlier, self.tolerance, p.loss,
                               {"resume_step": self.resume_step, "check": "redone_step",
                                "redone_compared": self.compared})
        found = None if self.window_checked else self._first_window(p)
        self.done = found is not None or (self.window_checked and max(self.redone, default=-1) <= p.step)
        return found

    def _first_window(self, p: Progress) -> Finding | None:
        assert p.loss is not None
        n = len(self.before)
        if n < MIN_WINDOW:
            self.window_checked = True
            return None
        self.after.append(p.loss)
        if len(self.after) == EDGE:
            edge = edge_jump(self.before_steps, self.before, self.after, self.cfg.resume_level_tolerance,
                             self.cfg.divergence_min_rise)
            if edge is not None:
                self.window_checked = True
                level, after_level, threshold = edge
                return Finding(HealthKind.RESUME_DIVERGENCE,
                               f"resumed from step {self.resume_step}: the median loss of its first {EDGE} logged "
                               f"steps is {after_level:.4g}, the level at the resume point {level:.4g} (threshold "
                               f"{threshold:.4g}: health.resume_level_tolerance "
                               f"{self.cfg.resume_level_tolerance:g}, or {NOISE_Z:g} x the noise of the {n} "
                               "losses before)", self.resume_step + 1, p.step, EDGE, level, threshold, after_level,
                               {"resume_step": self.resume_step, "check": "resume_point"})
        if len(self.after) < n:
            return None
        self.window_checked = True
        jump = window_jump(self.before, self.after, self.cfg.resume_level_tolerance, self.cfg.divergence_min_rise)
        if jump is None:
            return None
        level_before, level_after, threshold = jump
        return Finding(HealthKind.RESUME_DIVERGENCE,
                       f"resumed from step {self.resume_step}: the median loss of its first {n} logged steps is "
                       f"{level_after:.4g}, of the {n} before the resume point {level_before:.4g} (threshold "
                       f"{threshold:.4g}, health.resume_level_tolerance {self.cfg.resume_level_tolerance:g})",
                       self.resume_step + 1, p.step, n, level_before, threshold, level_after,
                       {"resume_step": self.resume_step, "check": "first_window"})


def _start(start: Start) -> Check:
    """The resume check of a resumed attempt; an attempt from scratch has nothing to compare."""
    if start.resume_step is None:
        return lambda snap: []
    check = ResumeCheck(start.resume_step, start.earlier, start.cfg, start.resume_loss_tolerance, start.weights_only)

    def observe(snap: Snapshot) -> list[Finding]:
        f = None if snap.record is None else check.observe(snap.record)
        return [] if f is None else [f]
    return observe


DETECTOR = Detector("resume", "step", _start)
