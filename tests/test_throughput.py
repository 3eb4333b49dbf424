"""Throughput health (domain/health/throughput.py): table tests, false-positive rows first."""
from __future__ import annotations

import random

import pytest

from orchestrator.types import HealthKind
from orchestrator.domain.health.action import slowdown_action
from orchestrator.domain.health.throughput import ThroughputParams, ThroughputTracker

# A run's timeline as segments: (steps, seconds per step) trains; ("save", s) / ("eval", s) pause for s
# seconds after the previous step, the loop told of it (pause()); ("pause", s) is a pause it was not told of.


def feed(segments, *, jitter=0.0, poll_s=0.0, logging_steps=1, params=None, reference_s=None, start_step=0,
         seed=1):
    """Kinds of the findings the tracker returns over the timeline, in order, with the step of each."""
    rnd = random.Random(seed)
    tr = ThroughputTracker(params or ThroughputParams(), reference_s=reference_s)
    t, step, out = 1000.0, start_step, []
    for seg in segments:
        if isinstance(seg[0], str):
            kind, secs = seg
            if kind in ("save", "eval"):
                tr.pause(step)
            t += secs
            continue
        n, per = seg
        for _ in range(n):
            t += per * (1 + rnd.uniform(-jitter, jitter))
            step += 1
            if step % logging_steps:
                continue
            seen = (int(t / poll_s) + 1) * poll_s if poll_s else t   # read at the next poll
            out += [(f.kind, f.details["step"]) for f in tr.observe(step, seen)]
    return [k for k, _ in out], tr


# ---- false positives: none of these is a slowdown
@pytest.mark.parametrize("segments, kw", [
    pytest.param([(2000, 1.0)], {}, id="steady"),
    pytest.param([(2000, 1.0)], {"jitter": 0.3}, id="jitter 30%"),
    pytest.param([(2000, 0.05)], {"jitter": 0.2, "poll_s": 0.5}, id="tiny steps read every 0.5 s"),
    pytest.param([(10, 20.0), (2000, 1.0)], {}, id="slow warm-up"),
    pytest.param([(500, 1.0), ("save", 300), (500, 1.0), ("save", 300), (500, 1.0)], {}, id="save pauses"),
    pytest.param([(500, 1.0), ("eval", 900), (500, 1.0)], {}, id="eval step, told"),
    pytest.param([(500, 1.0), ("pause", 900), (500, 1.0)], {}, id="eval step, not told"),
    pytest.param([(500, 1.0)] + [(50, 1.0), ("pause", 120)] * 20, {}, id="frequent evals, not told"),
    pytest.param([(500, 1.0), (3, 30.0), (500, 1.0)], {}, id="a few slow steps"),
    pytest.param([(500, 1.0), (200, 2.0), (500, 1.0)], {}, id="slow for 400 s < window"),
    pytest.param([(500, 1.0), (2000, 1.4)], {}, id="1.4x: under the ratio"),
    pytest.param([(200, 1.0), (5, 1.0), ("save", 600), ("eval", 900)], {}, id="the end of training"),
    pytest.param([(15, 3.0)], {}, id="a short run: no baseline"),
    pytest.param([(300, 60.0)], {"logging_steps": 5}, id="steps of a minute, logged every 5"),
    pytest.param([(10, 1.0), (4, 0.5), (2000, 1.0)], {}, id="a few fast steps in the baseline"),
])
def test_no_finding(segments, kw):
    kinds, _ = feed(segments, **kw)
    assert kinds == []


# ---- true positives
@pytest.mark.parametrize("segments, kw, expect", [
    pytest.param([(500, 1.0), (2000, 2.0)], {}, [HealthKind.THROUGHPUT_DROP], id="2x, sustained"),
    pytest.param([(500, 1.0), (1000, 2.0), (1000, 1.0)], {}, [HealthKind.THROUGHPUT_DROP, HealthKind.THROUGHPUT_RECOVERED],
                 id="2x then back"),
    pytest.param([(500, 1.0), (1000, 3.0), (500, 1.0), (1000, 3.0)], {"jitter": 0.2},
                 [HealthKind.THROUGHPUT_DROP, HealthKind.THROUGHPUT_RECOVERED, HealthKind.THROUGHPUT_DROP], id="twice, with jitter"),
    pytest.param([(2000, 0.05), (20000, 0.2)], {"poll_s": 0.5, "jitter": 0.2}, [HealthKind.THROUGHPUT_DROP],
                 id="tiny steps 4x slower, read every 0.5 s"),
    pytest.param([(100, 60.0), (300, 120.0)], {"logging_steps": 5}, [HealthKind.THROUGHPUT_DROP],
                 id="steps of a minute, 2x"),
    pytest.param([(500, 1.0), (500, 2.0), ("save", 300), (1000, 2.0)], {}, [HealthKind.THROUGHPUT_DROP],
                 id="slow across a save"),
])
def test_finding(segments, kw, expect):
    kinds, _ = feed(segments, **kw)
    assert kinds == expect


def test_drop_waits_for_the_window_and_reports_its_numbers():
    tr = ThroughputTracker(ThroughputParams(slowdown_window_s=600))
    t, found = 0.0, []
    for s in range(1, 101):
        t += 1.0
        tr.observe(s, t)
    slow_from = t
    s = 100
    while not found:
        s += 1
        t += 2.0
        found = tr.observe(s, t)
    f = found[0]
    assert f.kind == HealthKind.THROUGHPUT_DROP
    assert f.details["baseline_s"] == pytest.approx(1.0)
    assert f.details["ratio"] == pytest.approx(2.0)
    # the median turns slow after half of sample_s, then the window must pass in full
    assert 600 <= t - slow_from <= 600 + tr.params.sample_s
    assert f.details["window_s"] >= 600
    assert f.record()["ratio"] == 2.0 and "2.00x" in f.message
    assert tr.ratio == pytest.approx(2.0)


def test_reference_baseline_catches_an_attempt_slow_from_its_start():
    kinds, tr = feed([(2000, 2.0)], reference_s=1.0)
    assert kinds == [HealthKind.THROUGHPUT_DROP] and tr.baseline_s == 1.0
    # a faster attempt keeps its own baseline
    _, tr = feed([(200, 0.5)], reference_s=1.0)
    assert tr.baseline_s == pytest.approx(0.5)


def test_hysteresis_no_flapping_at_the_threshold():
    # slow at 2x, then 1.3x: above recover_at (1.25) -> stays dropped, no recovery, no second drop
    kinds, _ = feed([(500, 1.0), (1000, 2.0), (2000, 1.3)])
    assert kinds == [HealthKind.THROUGHPUT_DROP]


def test_repeats_and_same_pass_records_are_ignored():
    tr = ThroughputTracker()
    assert tr.observe(5, 10.0) == []
    assert tr.observe(5, 11.0) == [] and tr.last == (5, 10.0)
    assert tr.observe(6, 10.0) == [] and tr.last == (5, 10.0)


@pytest.mark.parametrize("on, last, now, expect", [
    ("warn", None, 10_000.0, "warn"),
    ("restart", None, 10_000.0, "restart"),
    ("restart", 10_000.0 - 3599, 10_000.0, "warn"),    # restarted within the hour: warn only
    ("restart", 10_000.0 - 3600, 10_000.0, "restart"),
    ("warn", 0.0, 10_000.0, "warn"),
])
def test_slowdown_action(on, last, now, expect):
    act = slowdown_action(on, now, last)
    assert act.action == expect and act.reason


def test_open_spell_for_the_goodput_span():
    _, tr = feed([(500, 1.0), (2000, 2.0)])
    assert tr.dropped is not None
    since = tr.dropped.since
    assert tr.open_spell(since + 50.0) == (since, since + 50.0)
    _, tr = feed([(500, 1.0), (1000, 2.0), (1000, 1.0)])
    assert tr.open_spell(1e9) is None


def test_bursts_between_throttled_gaps_are_a_slowdown():
    """A CPU quota lets a trainer of 1 ms steps run 4 ms bursts at full speed, then stops it for 96 ms: each
    single gap but one looks normal, a measurement over several periods does not."""
    p = ThroughputParams(slowdown_window_s=2.0, sample_s=1.0, bucket_s=0.5, warmup_steps=20, baseline_gaps=5)
    kinds, tr = feed([(5000, 0.001)] + [(4, 0.001), ("pause", 0.096)] * 300 + [(5000, 0.001)], params=p)
    assert kinds == [HealthKind.THROUGHPUT_DROP, HealthKind.THROUGHPUT_RECOVERED]
    # ... which a single-gap median (bucket_s = 0) misses
    kinds, _ = feed([(5000, 0.001)] + [(4, 0.001), ("pause", 0.096)] * 300, params=ThroughputParams(
        slowdown_window_s=2.0, sample_s=1.0, bucket_s=0.0, warmup_steps=20, baseline_gaps=5))
    assert kinds == []


def test_params_from_the_recipe_scale_the_measuring_windows():
    assert ThroughputParams.from_health() == ThroughputParams()
    short = ThroughputParams.from_health(2.0, 2.0)
    assert (short.slowdown_ratio, short.slowdown_window_s, short.sample_s, short.bucket_s) == (2.0, 2.0, 1.0, 0.5)
    assert short.recover_at == 1.5
