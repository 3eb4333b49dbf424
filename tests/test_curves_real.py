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
        assert d["source"].startswith("https://github.com/") and "/blob/" in d["source"], name
        assert d["label"] in ("healthy", "spike", "divergence", "nan", "resume_jump"), name
        assert (d["onset"] is None) == (d["label"] == "healthy"), name
        # held out iff the first 8 hex digits of sha256(source) fall below 30 % of 2**32, drawn before tuning
        held = int(hashlib.sha256(d["source"].encode()).hexdigest()[:8], 16) < 0.3 * 2**32
        assert d["split"] == ("heldout" if held else "tune"), name
        steps = [p["step"] for p in d["points"]]
        assert len(steps) >= 40 and steps == sorted(set(steps)), name


@pytest.mark.parametrize("name", [n for n, d in DOCS.items() if d["label"] == "healthy"])
def test_no_healthy_real_series_is_stopped(name):
    stops, warnings, n = measure.replay(DOCS[name])
    assert stops == [], name
    assert len(warnings) <= max(3, n // 50), name   # warnings only, and rare (README: per 1,000 steps)
