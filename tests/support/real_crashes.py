"""The real crash-excerpt collections (tests/fixtures/real, real2..real4, ../shared/crash-logs) and their scorer."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
_spec = importlib.util.spec_from_file_location("real_measure", _FIXTURES / "real" / "measure.py")
assert _spec and _spec.loader
measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure)

REAL, REAL2, REAL3, REAL4 = measure.HERE, measure.REAL2, measure.REAL3, measure.REAL4
REAL_INDEX = measure.load_index(REAL)
REAL2_INDEX = measure.load_index(REAL2)
REAL3_INDEX = measure.load_index(REAL3)
REAL4_INDEX = measure.load_index(REAL4)
SHARED = measure.SHARED if (measure.SHARED / "index.jsonl").is_file() else None
SHARED_INDEX = measure.load_index(SHARED) if SHARED else []
ALL_REAL = REAL_INDEX + REAL2_INDEX + REAL3_INDEX + REAL4_INDEX + SHARED_INDEX


def split(index: list[dict], name: str) -> list[dict]:
    """The entries of one split ('tune' or 'heldout')."""
    return [e for e in index if e["split"] == name]
