"""Slowdowns for the ETT simulation (simulate.py): when the machine trains below its baseline speed. Pure, seeded.

`orchestrator simulate --slowdown SHARE:SPEED` (repeatable): SHARE of the wall-clock hours (0-1) run at
SPEED x the baseline speed (0-1), e.g. `--slowdown 0.1:0.66` = one hour in ten at two thirds of the
speed (a step takes 1/0.66 = 1.5x as long). Each hour is drawn independently, from a random stream of its
own (seed and hour), so both loops meet the same slow hours.

What each loop does about it:
  plain          nothing notices: it trains on at that speed.
  orchestrator   throughput health (domain/health/throughput.py) notices a speed under 1/slowdown_ratio of the
                 baseline `detect_s` after it began (slowdown_window_s plus its measuring window), no sooner
                 than `baseline_steps` into an attempt. on_slowdown = "warn": trains on like the plain loop
                 (the time is charged, and the operator told). "restart": a graceful stop at the next save
                 (nothing to redo), a relaunch (exit, verify, start-up), at most one per hour; the restart
                 clears the slowdown for the rest of its hour with probability `restart_fixes` (software
                 causes such as a leaking or fragmented process or a stuck dataloader clear; a throttled GPU
                 or a noisy neighbour does not).
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

HOUR = 3600.0
BASELINE_STEPS = 20   # throughput.py: warm-up steps + baseline gaps before an attempt has a baseline


def parse_slowdown(text: str) -> tuple[float, float]:
    """"SHARE:SPEED" -> (share of hours, speed); ValueError saying what is wrong."""
    share, sep, speed = text.partition(":")
    try:
        f, v = float(share), float(speed)
    except ValueError:
        f = v = math.nan
    if not sep or not (0 < f <= 1) or not (0 < v <= 1):
        raise ValueError(f"--slowdown {text!r}: expected SHARE:SPEED, the share of hours (0-1] at that speed "
                         f"(0-1] of the baseline, e.g. 0.1:0.66")
    return f, v


def check_slowdowns(slowdowns: tuple[tuple[float, float], ...]) -> None:
    """ValueError when the shares add up to more than every hour."""
    if sum(f for f, _ in slowdowns) > 1 + 1e-9:
        raise ValueError(f"--slowdown shares add up to {sum(f for f, _ in slowdowns):g} > 1 (of all hours)")


@dataclass
class SlowSchedule:
    """Each wall-clock hour's speed (1.0: the baseline), and the hours a restart cleared from some time on."""

    slowdowns: tuple[tuple[float, float], ...] = ()
    seed: int = 0
    cleared: dict[int, float] = field(default_factory=dict)   # hour -> normal speed from this time on
    drawn: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"restart-{self.seed}")   # a restart's luck, apart from the hours' draws

    @property
    def active(self) -> bool:
        return bool(self.slowdowns)

    def hour_speed(self, h: int) -> float:
        if h not in self.drawn:
            u, acc, self.drawn[h] = random.Random(f"slow-{self.seed}-{h}").random(), 0.0, 1.0
            for share, speed in self.slowdowns:
                acc += share
                if u < acc:
                    self.drawn[h] = speed
                    break
        return self.drawn[h]

    def pieces(self, t: float) -> Iterator[tuple[float, float, float]]:
        """(start, end, speed) from t on, piecewise constant, without end."""
        while True:
            h = int(t // HOUR)
            end = (h + 1) * HOUR
            speed = self.hour_speed(h)
            cut = self.cleared.get(h)
            if cut is not None and t < cut < end:
                yield t, cut, speed
                t = cut
            yield t, end, 1.0 if cut is not None and t >= cut else speed
            t = end

    def wall(self, t0: float, steps: float, dt: float) -> float:
        """Seconds to train `steps` steps of `dt` baseline seconds from t0."""
        if not self.active or steps <= 0:
            return max(0.0, steps) * dt
        left = steps
        for a, b, v in self.pieces(t0):
            can = (b - a) * v / dt
            if can >= left:
                return a + left * dt / v - t0
            left -= can
        raise AssertionError("unreachable")

    def steps_in(self, t0: float, t1: float, dt: float) -> float:
        """Steps trained between t0 and t1."""
        if not self.active:
            return max(0.0, t1 - t0) / dt
        done = 0.0
        for a, b, v in self.pieces(t0):
            if a >= t1:
                return done
            done += (min(b, t1) - a) * v / dt

        raise AssertionError("unreachable")

    def detection(self, t0: float, t_end: float, ratio: float, detect_s: float, not_before: float) -> float | None:
        """The first time in [t0, t_end) at which the speed has been under 1/ratio for detect_s without a
        break (and not before `not_before`); None if none."""
        onset = None
        for a, b, v in self.pieces(t0):
            if a >= t_end:
                return None
            if v * ratio >= 1:   # not slow enough to be told from noise
                onset = None
                continue
            onset = a if onset is None else onset
            at = max(onset + detect_s, not_before, a)
            if at < b:
                return at if at < t_end else None
        return None

    def restart_step(self, t0: float, ckpt: int, run_steps: float, dt: float, k: int, ratio: float,
                     detect_s: float, not_before: float) -> int | None:
        """on_slowdown = "restart": the save step (a multiple of k) at which an attempt that began training
        at t0 from step `ckpt` stops for a slowdown, if that comes within its `run_steps` (before its crash
        or the end); None otherwise."""
        if not self.active:
            return None
        start = t0 + self.wall(t0, BASELINE_STEPS, dt)
        td = self.detection(start, t0 + self.wall(t0, run_steps, dt), ratio, detect_s, not_before)
        if td is None:
            return None
        stop = (math.floor((ckpt + self.steps_in(t0, td, dt)) / k) + 1) * k
        return stop if stop - ckpt < run_steps else None

    def clear(self, t: float) -> None:
        """A restart at t fixed the slowdown: normal speed for the rest of that hour."""
        self.cleared[int(t // HOUR)] = t
