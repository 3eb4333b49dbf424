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
        # a kept raw line is the point's line: the parser reads the step the point names
        for p in d["points"]:
            assert "line" not in p or measure.from_line(p).step == p["step"], name
        # a resume jump names the checkpoint step resumed from; its onset is a step of the resumed attempt
        assert ("resume_from" in d) == (d["label"] == "resume_jump"), name
        assert "resume_from" not in d or d["resume_from"] < d["onset"], name


@pytest.mark.parametrize("name", [n for n, d in DOCS.items() if d["label"] == "healthy"])
def test_no_healthy_real_series_is_stopped(name):
    # replayed as measure.py replays it: an fp16 run's loss scaler skips overflowed updates (NaN/Inf grad norm)
    stops, warnings, n = measure.replay(DOCS[name], fp16=measure.is_fp16(DOCS[name]))
    assert stops == [], name
    assert len(warnings) <= max(3, n // 50), name   # warnings only, and rare (README: per 1,000 steps)


# A documented failure the detectors miss is listed here (file -> why), a strict xfail. apex#493 logs one
# validation loss an epoch (5 lines: the 5th is judged against 4, under the 5 a spike needs); chainer#1733's jump
# lasts one epoch (x2.7, then below the level before): the resume check's level after the resume is a median of
# 3 logged steps, so one line is an outlier it drops, as it must for a resume's first-step bump. The unsloth
# thread's nine lines (a grad-norm spike ~1500x at step 9) were one until spikes were judged before the window
# fills (loss.EARLY_SPIKE_MIN); the Megatron-LLM#33 line with no `lm loss` until the parser read it as NaN.
# xlnet#124 (12 lines) and the GaussianImage note (14 lines) document slow divergences: the divergence check
# compares medians of divergence_window (20) logged steps, more lines than either source holds.
KNOWN_MISSES = {"issue-apex-493-fp16-spike.json": "5 validation losses, one per epoch: too few to judge a spike",
                "issue-chainer-1733-resume-jump.json": "a one-line jump: the median-of-3 edge level drops it",
                "issue-xlnet-124-pretrain-divergence.json": "12 lines, a slow rise (7.60 -> 7.93): under a 20-step window",
                "gaussianimage-adam-divergence-1600.json": "14 sparse lines (0.071 -> 0.31): under a 20-step window"}


def labelled(label: str) -> list:
    """The series labelled `label`, as test parameters: a known miss is a strict xfail with its reason."""
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[n])) if n in KNOWN_MISSES
            else n for n, d in DOCS.items() if d["label"] == label]


def replayed(name: str) -> tuple[list, list, dict]:
    """(stops, warnings, the series) of one series, replayed as measure.py replays it."""
    d = DOCS[name]
    stops, warnings, _ = measure.replay(d, fp16=measure.is_fp16(d))
    return stops, warnings, d


@pytest.mark.parametrize("name", labelled("nan"))
def test_a_documented_nan_stops_the_run_at_its_onset(name):
    stops, _, d = replayed(name)
    assert stops and stops[0] == ("nan_andon", d["onset"]), name


# deeplab-lfov#5 (30 lines): a loss_spike warning at 13000 (5.128 after ~1); no divergence stop on so few lines
@pytest.mark.parametrize("name", labelled("divergence") + labelled("spike"))
def test_a_documented_divergence_or_spike_is_at_least_warned_of_after_its_onset(name):
    stops, warnings, d = replayed(name)
    assert any(step >= d["onset"] for _, step in stops + warnings), name


@pytest.mark.parametrize("name", labelled("resume_jump"))
def test_a_documented_resume_jump_is_found_on_the_resumed_attempt(name):
    stops, _, d = replayed(name)
    assert stops and stops[0][0] == "resume_divergence" and stops[0][1] >= d["onset"], name
