"""Real loss / grad-norm curves (tests/fixtures/curves/, issue 35 item 4) replayed through the run-health
detectors with the default [health] settings: no healthy series may be stopped, held out or not."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "fixtures" / "curves"
spec = importlib.util.spec_from_file_location("curves_measure", HERE / "measure.py")
assert spec and spec.loader
measure = importlib.util.module_from_spec(spec)
spec.loader.exec_module(measure)
DOCS = {p.name: measure.load(p) for p in sorted(HERE.glob("*.json"))}


def test_every_series_has_a_pinned_source_a_label_and_its_drawn_split():
    assert len(DOCS) >= 17
    for name, d in DOCS.items():
        # a file at a pinned commit, or (failing series) the public issue thread that pastes the lines
        assert d["source"].startswith("https://github.com/") and ("/blob/" in d["source"]
                                                                  or "/issues/" in d["source"]), name
        assert d["label"] in ("healthy", "spike", "divergence", "nan", "resume_jump"), name
        assert (d["onset"] is None) == (d["label"] == "healthy"), name
        # held out iff the first 8 hex digits of sha256(source) fall below 30 % of 2**32, drawn before tuning
        held = int(hashlib.sha256(d["source"].encode()).hexdigest()[:8], 16) < 0.3 * 2**32
        assert d["split"] == ("heldout" if held else "tune"), name
        steps = [p["step"] for p in d["points"]]
        # a whole run's curve, or (labelled partial) the lines a thread pastes around its failure
        assert len(steps) >= (3 if d.get("partial") else 40) and steps == sorted(set(steps)), name
        assert not d.get("partial") or d["label"] != "healthy", name


@pytest.mark.parametrize("name", [n for n, d in DOCS.items() if d["label"] == "healthy"])
def test_no_healthy_real_series_is_stopped(name):
    # replayed as measure.py replays it: an fp16 run's loss scaler skips overflowed updates (NaN/Inf grad norm)
    stops, warnings, n = measure.replay(DOCS[name], fp16=measure.is_fp16(DOCS[name]))
    assert stops == [], name
    assert len(warnings) <= max(3, n // 50), name   # warnings only, and rare (README: per 1,000 steps)


# Megatron leaves a NaN average out of its line (no `lm loss` field) and, in that thread, its nan counter stayed 0:
# the detectors see a step with no loss, not a NaN. A miss reported to the lead (issue 35), not tuned here.
# The unsloth thread pastes nine lines: fewer than the spike window (20 logged steps) the spike checks fill before
# they judge, so its grad-norm spike (step 4, then ~1500x at step 9) is not judged. Reported, not tuned here.
KNOWN_MISSES = {"issue-megatron-llm-33-nan.json": "a Megatron line with no lm loss is not read as a NaN",
                "issue-unsloth-5207-gradnorm-spike.json": "9 lines, fewer than the 20-step spike window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[n]))
                                  if n in KNOWN_MISSES else n
                                  for n, d in DOCS.items() if d["label"] == "nan"])
def test_a_documented_nan_stops_the_run_at_its_onset(name):
    d = DOCS[name]
    stops, _, _ = measure.replay(d, fp16=measure.is_fp16(d))
    assert stops and stops[0] == ("nan_andon", d["onset"]), name


def test_the_documented_divergence_is_at_least_warned_of_after_its_onset():
    d = DOCS["issue-deeplab-lfov-5-divergence.json"]
    stops, warnings, _ = measure.replay(d)
    # measured: a loss_spike warning at 13000 (5.128 after ~1), no divergence stop on these 30 lines (README)
    assert any(step >= d["onset"] for _, step in stops + warnings)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[n]))
                                  if n in KNOWN_MISSES else n
                                  for n, d in DOCS.items() if d["label"] == "spike"])
def test_a_documented_spike_is_at_least_warned_of_after_its_onset(name):
    d = DOCS[name]
    stops, warnings, _ = measure.replay(d, fp16=measure.is_fp16(d))
    assert any(step >= d["onset"] for _, step in stops + warnings), name
