"""Throughput health: is this attempt training slower than it did at its start? Pure: no clock, no I/O.

Evidence: the (step, seen at) records the supervisor already keeps for costs.py (`monotonic` read times,
good to poll_s). ms-swift's own `train_speed(s/it)` is an average since the process started, so it moves
too slowly to show a drop and is not used here.

  per-step time   the gaps between step records read at different times, gathered into measurements of
                  at least `bucket_s` each: seconds / steps advanced. A gap that starts at a save or an
                  evaluation (`pause`) is left out, as costs.step_seconds does: what it measures is the
                  pause, not training. Gathering matters for short steps: a CPU quota (CFS, 100 ms periods)
                  lets a trainer of 1 ms steps run bursts at full speed between throttled gaps, which a
                  median of single gaps would not see.
  baseline        after `warmup_steps` of the attempt (compilation, caches, the first data loads), the
                  median per-step time of the next `baseline_gaps` gaps; or `reference_s` (a previous
                  attempt's baseline) when that is faster: an attempt relaunched onto a degraded GPU is
                  slow from its first step and must not take its slowness as normal.
  current         the median per-step time of the gaps that ended in the last `sample_s`, or of the last
                  `min_gaps` gaps where fewer ended in it (steps of minutes). A median: a few slow steps, a save or an eval the supervisor did
                  not see as one, and jitter do not move it; a sustained slowdown does.
  drop            current / baseline above `slowdown_ratio` at every evaluation for `slowdown_window_s`
                  -> `throughput_drop` (once). Recovered: the ratio back under `recover_ratio` (hysteresis,
                  so a run at the threshold does not flap) -> `throughput_recovered` (once).

The tracker is the "timed" detector of HealthWatch's list (DETECTOR): fed every step record with the time it
was read and every save or evaluation step, it returns each transition exactly once; the loop journals it, takes
the machine's evidence (host/slowdown_evidence.py) and acts as action.act says (health.on_slowdown).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from orchestrator.domain.health.detector import Detector, Snapshot, Start
from orchestrator.domain.health.kinds import Finding
from orchestrator.types import HealthKind




@dataclass(frozen=True)
class ThroughputParams:
    slowdown_ratio: float = 1.5       # health.slowdown_ratio
    slowdown_window_s: float = 600.0  # health.slowdown_window_s
    warmup_steps: int = 10            # steps of each attempt not measured (start-up effects)
    baseline_gaps: int = 10           # gaps whose median is the baseline
    sample_s: float = 120.0           # the window `current` is the median over
    min_gaps: int = 5                 # measurements `current` needs at least (fewer: no verdict)
    bucket_s: float = 2.0             # seconds of step gaps gathered into one measurement (4 polls of 0.5 s)
    recover_ratio: float | None = None  # default: halfway between 1 and slowdown_ratio

    @classmethod
    def from_health(cls, slowdown_ratio: float = 1.5, slowdown_window_s: float = 600.0) -> ThroughputParams:
        """The recipe's two health keys, with the measuring windows scaled to the window where it is short
        (tests, demos): `sample_s` at most half of it, `bucket_s` at most a quarter."""
        return cls(slowdown_ratio, slowdown_window_s, sample_s=min(120.0, slowdown_window_s / 2),
                   bucket_s=min(2.0, slowdown_window_s / 4))

    @property
    def recover_at(self) -> float:
        return self.recover_ratio if self.recover_ratio is not None else 1.0 + (self.slowdown_ratio - 1.0) / 2


def transition(kind: HealthKind, at: float, step: int, ratio: float, current_s: float, baseline_s: float,
               window_s: float, since: float) -> Finding:
    """One transition as a Finding: `at` the time of the record that decided it, `since` when the slow spell
    began (the caller's clock); `window_s` how long the ratio had been beyond (drop) or the spell lasted
    (recovered). Its numbers are the journal event's."""
    what = "slower than" if kind == HealthKind.THROUGHPUT_DROP else "back to"
    return Finding(kind, f"step {step}: {current_s:.3g} s/step, {ratio:.2f}x the baseline {baseline_s:.3g} s/step "
                         f"({what} baseline for {window_s:.0f} s)",
                   details={"step": step, "ratio": round(ratio, 3), "current_s": round(current_s, 6),
                            "baseline_s": round(baseline_s, 6), "window_s": round(window_s, 1)},
                   at=at, since=since)


@dataclass
class ThroughputTracker:
    """One attempt's throughput watch. Feed it every step record in order (`observe`) and every save or
    evaluation step it learns of (`pause`); it answers the transitions."""

    params: ThroughputParams = field(default_factory=ThroughputParams)
    reference_s: float | None = None        # a previous attempt's baseline, when known
    first_step: int | None = None
    last: tuple[int, float] | None = None   # (step, at) of the newest record with a new read time
    pauses: set[int] = field(default_factory=set)
    warmup_gaps: list[float] = field(default_factory=list)
    baseline_s: float | None = None
    gaps: deque[tuple[float, float]] = field(default_factory=deque)   # (ended at, seconds per step)
    acc: tuple[float, int] = (0.0, 0)       # the measurement being gathered: (seconds, steps)
    slow_since: float | None = None
    dropped: Finding | None = None          # the open drop, until recovered

    def __call__(self, snap: Snapshot) -> list[Finding]:
        """The transitions of a snapshot: a step record read at snap.now, or a pause after snap.paused_after."""
        if snap.paused_after is not None:
            self.pause(snap.paused_after)
            return []
        return [] if snap.record is None else self.observe(snap.record.step, snap.now)

    def pause(self, step: int) -> None:
        """The trainer saved or evaluated after `step`: the gap starting there is not training time."""
        self.pauses.add(step)

    def observe(self, step: int, at: float) -> list[Finding]:
        """One step record read at time `at` (one clock throughout: the wall clock's `now` makes a drop's
        `since` usable as a goodput span start). Returns the transitions it decides (usually none)."""
        if self.first_step is None:
            self.first_step = step
        if self.last is not None and (step <= self.last[0] or at <= self.last[1]):
            return []   # a repeat, or read in the same pass as the last one: no timing in it
        prev, self.last = self.last, (step, at)
        if prev is None or step - self.first_step <= self.params.warmup_steps:
            return []
        s0, t0 = prev
        paused = any(s0 <= p < step for p in self.pauses)
        self.pauses = {p for p in self.pauses if p >= step}
        if paused:
            return []
        secs, steps = self.acc[0] + at - t0, self.acc[1] + step - s0
        if secs < self.params.bucket_s:
            self.acc = (secs, steps)
            return []
        self.acc, per_step = (0.0, 0), secs / steps
        if self.baseline_s is None:
            self.warmup_gaps.append(per_step)
            if len(self.warmup_gaps) >= self.params.baseline_gaps:
                own = median(self.warmup_gaps)
                self.baseline_s = min(own, self.reference_s) if self.reference_s else own
            return []
        self.gaps.append((at, per_step))
        # the last sample_s, but never fewer than min_gaps gaps: steps of minutes still get a verdict
        while len(self.gaps) > self.params.min_gaps and self.gaps[0][0] < at - self.params.sample_s:
            self.gaps.popleft()
        if len(self.gaps) < self.params.min_gaps:
            return []
        return self._judge(step, at, median(g for _, g in self.gaps))

    def _judge(self, step: int, at: float, current: float) -> list[Finding]:
        assert self.baseline_s is not None
        p, ratio = self.params, current / self.baseline_s
        if self.dropped is None:
            if ratio <= p.slowdown_ratio:
                self.slow_since = None
                return []
            if self.slow_since is None:
                self.slow_since = at
            if at - self.slow_since < p.slowdown_window_s:
                return []
            self.dropped = transition(HealthKind.THROUGHPUT_DROP, at, step, ratio, current, self.baseline_s,
                                      at - self.slow_since, self.slow_since)
            return [self.dropped]
        if ratio > p.recover_at:
            return []
        since = self.dropped.since
        assert since is not None
        self.dropped, self.slow_since = None, None
        return [transition(HealthKind.THROUGHPUT_RECOVERED, at, step, ratio, current, self.baseline_s, at - since,
                           since)]

    def open_spell(self, end: float) -> tuple[float, float] | None:
        """The slow spell still open at `end` (an attempt's end): (since, end) for a goodput span of kind
        "slow"; None when none is open. A recovered spell's span is (finding.since, finding.at)."""
        since = None if self.dropped is None else self.dropped.since
        return None if since is None else (since, max(end, since))

    def close_spell(self, end: float) -> tuple[float, float] | None:
        """The slow spell still open at `end` (as open_spell), now closed: an attempt's end records it once."""
        spell = self.open_spell(end)
        self.dropped, self.slow_since = None, None
        return spell

    @property
    def ratio(self) -> float | None:
        """current / baseline now (for the metric orchestrator_throughput_ratio); None before a verdict."""
        if self.baseline_s is None or len(self.gaps) < self.params.min_gaps:
            return None
        return median(g for _, g in self.gaps) / self.baseline_s


def _start(start: Start) -> ThroughputTracker:
    """A throughput watch for one attempt, measured against its own baseline or the fastest of earlier ones."""
    return ThroughputTracker(ThroughputParams.from_health(start.cfg.slowdown_ratio, start.cfg.slowdown_window_s),
                             reference_s=start.baseline_s)


DETECTOR = Detector("throughput", "timed", _start)
