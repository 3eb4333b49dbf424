"""The seconds per step the throughput detector judges, rebuilt for the report from logging.jsonl. Pure.

The trainer's own `train_speed(s/it)` is an average since its process started (ms-swift:
elapsed / (step - start step)), so a drop late in a run barely moves it. What the detector judges
(domain/health/throughput.py) is the time between step records, gathered into measurements, its median over the
last `sample_s` against the attempt's baseline. Here each record's time since its process started is
rebuilt (train_speed x steps since the start step: sub-second, where it agrees with the record's
`elapsed_time`; else `elapsed_time` itself, whole seconds, gathered over longer measurements) and the
records of each attempt are fed, in the order logged, to a ThroughputTracker with the recipe's health
settings, saves as pauses: the report plots its measurements, its judged median and its baseline.
"""
from __future__ import annotations

import dataclasses
import json
import re
from statistics import median

from orchestrator.domain import progress
from orchestrator.domain.health.throughput import ThroughputParams, ThroughputTracker

_ELAPSED = re.compile(r"(\d+)\s*([dhms])")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
COARSE_BUCKET_S = 10.0   # measurements from whole-second elapsed_time: at least 10 s each (rounding under 10 %)


def elapsed_seconds(text: object) -> float | None:
    """Parses ms-swift's `elapsed_time` ("1d 2h 3m 4s", "3m 4s", "4s") into seconds; None when it is none."""
    if not isinstance(text, str):
        return None
    parts = _ELAPSED.findall(text)
    return float(sum(int(n) * _UNIT_S[u] for n, u in parts)) if parts else None


def timed_steps(lines: list[str], starts: list[int]) -> list[tuple[list[tuple[int, float]], bool]]:
    """Splits logging.jsonl lines into attempts (the step goes back, or the time since start does) and
    returns each as ([(step, seconds since its process started)], coarse): coarse when some time is whole
    seconds from `elapsed_time`. `starts` are the attempts' start steps from the journal."""
    segs: list[tuple[list[tuple[int, float]], bool]] = []
    cur: list[tuple[int, float]] = []
    coarse, s0 = False, 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        p = progress.from_record(rec) if isinstance(rec, dict) else None
        if p is None:
            continue
        el = elapsed_seconds(rec.get("elapsed_time"))
        if not cur or p.step <= cur[-1][0] or (el is not None and el < cur[-1][1] - 1.0):
            if cur:
                segs.append((cur, coarse))
            cur, coarse = [], False
            s0 = max([s for s in starts if s < p.step] + [0])
        speed = rec.get("train_speed(s/it)")
        at = speed * (p.step - s0) if isinstance(speed, (int, float)) and speed > 0 else None
        if at is None or (el is not None and abs(at - el) > max(2.0, 0.05 * el)):
            at, coarse = el, coarse or el is not None
        if at is not None:
            cur.append((p.step, at))
    return segs + ([(cur, coarse)] if cur else [])


def judged(segments: list[tuple[list[tuple[int, float]], bool]], pauses: set[int],
           params: ThroughputParams) -> dict:
    """Feeds each attempt's timed steps to a ThroughputTracker, as the loop does (the previous attempt's
    baseline as reference). Returns {"measured": [(step, s/step)], "current": [(step, judged median)],
    "baselines": [(first step, last step, baseline s/step)], "slowdown_ratio": ...}."""
    measured: list[tuple[int, float]] = []
    current: list[tuple[int, float]] = []
    baselines: list[tuple[int, int, float]] = []
    reference: float | None = None
    for steps, coarse in segments:
        p = dataclasses.replace(params, bucket_s=max(params.bucket_s, COARSE_BUCKET_S)) if coarse else params
        tr = ThroughputTracker(p, reference_s=reference)
        for s in pauses:
            tr.pause(s)
        for step, at in steps:
            n_warm, last_gap = len(tr.warmup_gaps), tr.gaps[-1] if tr.gaps else None
            tr.observe(step, at)
            if len(tr.warmup_gaps) > n_warm:
                measured.append((step, tr.warmup_gaps[-1]))
            elif tr.gaps and tr.gaps[-1] is not last_gap:
                measured.append((step, tr.gaps[-1][1]))
                if len(tr.gaps) >= p.min_gaps:
                    current.append((step, median(g for _, g in tr.gaps)))
        if tr.baseline_s is not None:
            baselines.append((steps[0][0], steps[-1][0], tr.baseline_s))
            reference = min(reference or tr.baseline_s, tr.baseline_s)
    return {"measured": measured, "current": current, "baselines": baselines,
            "slowdown_ratio": params.slowdown_ratio}
