"""Real loss series (tests/fixtures/health) as the loop reads them."""
from __future__ import annotations

import csv
from pathlib import Path

from orchestrator.types import Progress

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "health"


def real_csv(name: str) -> list[Progress]:
    with (FIXTURES / name).open() as f:
        return [Progress(step=int(r["step"]), loss=float(r["loss"]), grad_norm=float(r["grad_norm"]),
                         lr=float(r["learning_rate"])) for r in csv.DictReader(f)]
