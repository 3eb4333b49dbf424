"""A detector: a small named unit over a snapshot (NVRx's watch: `Detector(name, requires, fn)`). Pure.

Each detector module defines one `DETECTOR`; watch.py's DETECTORS lists them, and HealthWatch runs every one
on what it requires: "step" detectors see each new step record once, in step order; "timed" detectors see each
step record with when it was read (every record, repeats too: a repeat read later carries no new timing and
they say so) and each save or evaluation the loop learns of; "line" detectors see each log line with what the
progress parser got from it. `fn(start)` makes the detector's check for one attempt
(its state lives there, so a relaunch starts it afresh from what `start` says), and the check returns the
new findings of one snapshot: kinds.Finding, with a kind from types.HealthKind.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from orchestrator.config.schema import HealthSection
from orchestrator.domain.health.kinds import Finding
from orchestrator.types import Progress


@dataclass(frozen=True)
class Snapshot:
    """What one call of a check sees: a new step record (requires "step"); a step record and when it was read,
    or a step the trainer saved or evaluated after (requires "timed"); or a log line, what the parser got from
    it and when it was read (requires "line")."""

    record: Progress | None = None
    line: str | None = None
    parsed: Progress | None = None
    now: float = 0.0
    paused_after: int | None = None   # "timed": the trainer saved or evaluated after this step


@dataclass(frozen=True)
class Start:
    """An attempt's start: the recipe's health settings and where the attempt resumes from."""

    cfg: HealthSection
    resume_step: int | None = None                  # None: from scratch
    kept: Sequence[Progress] = ()                   # the run's step records up to the resume point, in order
    earlier: Mapping[int, float] = field(default_factory=dict)  # step -> loss logged before (no suspect steps)
    weights_only: bool = False                      # Resume.weights_only: no optimizer state
    fp16: bool = False                              # the run has a loss scaler
    resume_loss_tolerance: float = 0.05             # checkpoint.resume_loss_tolerance
    baseline_s: float | None = None                 # the fastest seconds per step of earlier attempts


class Check(Protocol):
    """One attempt's detector: the new findings of one snapshot."""

    def __call__(self, snap: Snapshot) -> list[Finding]: ...


@dataclass(frozen=True)
class Detector:
    """A named detector: what it reads (new "step" records, "timed" records and pauses, or log "line"s) and how
    to make its check per attempt."""

    name: str
    requires: Literal["step", "timed", "line"]
    fn: Callable[[Start], Check]
