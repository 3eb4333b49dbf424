"""Run health: detectors over the logged step records, for the failures that waste a run without crashing it.

Pure: no clock, no files. The loop feeds a HealthWatch with each new step record (HealthWatch.observe) and each
log line the progress parser did not turn into one (HealthWatch.line); each returns the new findings, each
condition reported once. What to do about a finding is action.py's; the resume checks are
resume.py's, the "progress but not understood" check progress_unreadable.py's.

Levels are robust: the median of a window of logged steps (and its MAD for spikes), so one noisy step, an
eval, a save pause or a short warm-up moves nothing. Windows count logged steps, not steps.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrator.config.schema import HealthSection
from orchestrator.domain.health.detector import Detector, Snapshot, Start
from orchestrator.domain.health.kinds import DIVERGENCE_KINDS, Finding
from orchestrator.types import HealthKind, Progress

# The fewest logged steps a spike is judged against, early in an attempt, before spike_window are in.
EARLY_SPIKE_MIN = 5


def robust_level(values: Sequence[float]) -> tuple[float, float]:
    """The median of `values` and their median absolute deviation from it."""
    med = statistics.median(values)
    return med, statistics.median(abs(v - med) for v in values)


def spike_threshold(history: Sequence[float], mads: float, min_ratio: float) -> tuple[float, float]:
    """(level, threshold): a value above threshold is a spike over `history`. Both bars must be cleared: mads x
    the MAD over the median (a noisy series needs a bigger jump) and min_ratio x the median (a flat series has
    a MAD near 0, where any wobble would count)."""
    level, mad = robust_level(history)
    return level, max(level + mads * mad, level * min_ratio if level > 0 else level)


def divergence_threshold(best: float, tolerance: float, min_rise: float) -> float:
    """The level above which the loss has risen too far over the best level: by `tolerance` relative to it,
    and by at least `min_rise` in loss units."""
    return best + max(tolerance * abs(best), min_rise)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


class _Latch:
    """One condition reported once: fires when it starts, re-arms after `rearm` clear observations in a row
    (so a value that hovers around its threshold does not report every other step)."""

    def __init__(self, rearm: int) -> None:
        self.rearm, self.active, self.clear = rearm, False, 0

    def update(self, condition: bool) -> bool:
        if condition:
            self.clear = 0
            fire, self.active = not self.active, True
            return fire
        self.clear += 1
        if self.active and self.clear >= self.rearm:
            self.active = False
        return False


class _Series:
    """One logged quantity (loss or grad norm): the recent values, their rolling level, and the best level."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)   # the last `window` finite values
        self.steps: deque[int] = deque(maxlen=window)
        self.level: float | None = None                     # median of values once `window` are in
        self.best: float | None = None                      # lowest level seen

    def add(self, step: int, value: float) -> None:
        self.values.append(value)
        self.steps.append(step)
        if len(self.values) == self.values.maxlen:
            self.level = statistics.median(self.values)
            self.best = self.level if self.best is None else min(self.best, self.level)


@dataclass
class _Divergence:
    """How long the loss level has been too high, and since which step."""

    since: int | None = None   # first step of the window whose level first went over
    count: int = 0             # logged steps in a row over


class LossHealth:
    """Spikes, divergence and absolute limits over the step records of one run, in step order. `observe`
    returns the new findings of one record."""

    def __init__(self, cfg: HealthSection) -> None:
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        c = self.cfg
        self.last_step: int | None = None
        self.spike_loss: deque[float] = deque(maxlen=c.spike_window)
        self.spike_grad: deque[float] = deque(maxlen=c.spike_window)
        self.loss = _Series(c.divergence_window)
        self.grad = _Series(c.divergence_window)
        self.over = _Divergence()
        self.grad_at_best: float | None = None
        self.latches = {k: _Latch(max(c.spike_window, c.divergence_window))
                        for k in (HealthKind.LOSS_SPIKE, HealthKind.GRAD_NORM_SPIKE, HealthKind.LOSS_DIVERGENCE, HealthKind.LOSS_LIMIT, HealthKind.GRAD_NORM_LIMIT)}

    def replay(self, records: Iterable[Progress]) -> None:
        """Start over from `records` (the run up to a resume point) without reporting what they show. A warning
        still on at the resume point was reported then and is not reported again; a condition the loop acts on
        (DIVERGENCE_KINDS, unless health.on_divergence = "warn") is found again if it persists: it is derived from
        the data, not remembered."""
        self.reset()
        for p in records:
            self.observe(p)
        c = self.cfg
        for kind in DIVERGENCE_KINDS if c.on_divergence != "warn" else ():
            self.latches[kind] = _Latch(max(c.spike_window, c.divergence_window))

    def __call__(self, snap: Snapshot) -> list[Finding]:
        """The findings of a snapshot's step record (the "step" detector's check)."""
        return [] if snap.record is None else self.observe(snap.record)

    def observe(self, p: Progress) -> list[Finding]:
        """The findings one new step record brings; a step at or before the last one observed is ignored
        (stdout and logging.jsonl report each step once each)."""
        if self.last_step is not None and p.step <= self.last_step:
            return []
        self.last_step = p.step
        found: list[Finding] = []
        c = self.cfg
        if _finite(p.loss):
            assert p.loss is not None
            found += self._limit(HealthKind.LOSS_LIMIT, "loss", p.step, p.loss, c.loss_max)
            found += self._spike(HealthKind.LOSS_SPIKE, "loss", self.spike_loss, p.step, p.loss, c.spike_min_ratio)
            self.loss.add(p.step, p.loss)
        if _finite(p.grad_norm):
            assert p.grad_norm is not None
            found += self._limit(HealthKind.GRAD_NORM_LIMIT, "grad norm", p.step, p.grad_norm, c.grad_norm_max)
            found += self._spike(HealthKind.GRAD_NORM_SPIKE, "grad norm", self.spike_grad, p.step, p.grad_norm,
                                 c.grad_norm_spike_min_ratio)
            self.grad.add(p.step, p.grad_norm)
        if _finite(p.loss):
            if self.loss.level is not None and self.loss.level == self.loss.best:
                self.grad_at_best = self.grad.level   # the grad-norm level when the loss was at its best
            found += self._divergence(p.step)
        return found

    def _limit(self, kind: HealthKind, what: str, step: int, value: float, limit: float | None) -> list[Finding]:
        if not self.latches[kind].update(limit is not None and value > limit):
            return []
        return [Finding(kind, f"{what} {value:.4g} at step {step} is over the limit {limit:g} "
                              f"(health.{'loss_max' if kind == HealthKind.LOSS_LIMIT else 'grad_norm_max'})",
                        step, step, None, None, limit, value)]

    def _spike(self, kind: HealthKind, what: str, history: deque[float], step: int, value: float,
               min_ratio: float) -> list[Finding]:
        found: list[Finding] = []
        if len(history) >= min(EARLY_SPIKE_MIN, history.maxlen or 0):
            # before the window fills, fewer steps judge: the bar rises as they are fewer (x window / steps in)
            scale = (history.maxlen or 1) / len(history)
            level, threshold = spike_threshold(history, self.cfg.spike_mads * scale, min_ratio * scale)
            if self.latches[kind].update(value > threshold):
                found.append(Finding(kind, f"{what} {value:.4g} at step {step} is a spike: the median of the last "
                                           f"{len(history)} logged steps is {level:.4g}, the spike threshold "
                                           f"{threshold:.4g}", step, step, len(history), level, threshold, value))
        # a spike joins the window too: the median shrugs off one, and a lasting jump becomes the new level
        history.append(value)
        return found

    def _divergence(self, step: int) -> list[Finding]:
        c, loss, grad = self.cfg, self.loss, self.grad
        if loss.level is None or loss.best is None:
            return []
        threshold = divergence_threshold(loss.best, c.divergence_tolerance, c.divergence_min_rise)
        half = divergence_threshold(loss.best, c.divergence_tolerance / 2, c.divergence_min_rise / 2)
        ref = self.grad_at_best
        grad_up = grad.level is not None and ref is not None and ref > 0 and grad.level > ref * (1 + c.grad_norm_rise)
        over = loss.level > threshold or (grad_up and loss.level > half)
        if over:
            if self.over.since is None:
                self.over.since = loss.steps[0]
            self.over.count += 1
        else:
            self.over = _Divergence()
        sustained = over and self.over.count >= c.divergence_window
        if not self.latches[HealthKind.LOSS_DIVERGENCE].update(sustained) or self.over.since is None:
            return []
        why = (f"over {threshold:.4g} (best {loss.best:.4g} + max({c.divergence_tolerance:g} x best, "
               f"{c.divergence_min_rise:g}))" if loss.level > threshold else
               f"over {half:.4g} while the grad-norm level rose from {ref:.4g} to {grad.level:.4g}")
        return [Finding(HealthKind.LOSS_DIVERGENCE, f"the loss level (median of {c.divergence_window} logged steps) is "
                                         f"{loss.level:.4g}, {why}, for {self.over.count} logged steps since step "
                                         f"{self.over.since}", self.over.since, step, c.divergence_window,
                        loss.best, threshold if loss.level > threshold else half, loss.level,
                        {"grad_norm_level": round(grad.level, 6), "grad_norm_at_best": round(ref, 6)}
                        if grad_up and grad.level is not None and ref is not None else {})]


def _start(start: Start) -> LossHealth:
    """A loss check for one attempt: it starts over from the records up to the resume point (replay)."""
    check = LossHealth(start.cfg)
    check.replay(start.kept)
    return check


DETECTOR = Detector("loss", "step", _start)
