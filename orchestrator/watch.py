"""Watching one attempt: tail its log and logging.jsonl, keep what was learnt (steps, losses).

This is the "gather" half of a pass; the verdicts (hang, NaN, resume divergence) are pure
functions in policy.py and progress.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orchestrator import progress
from orchestrator.checkpoints import logged_losses
from orchestrator.launcher import FileTail, Launched
from orchestrator.types import Attempt, Crash, Decision, Progress, Resume


def finished_record(jsonl_line: str) -> bool:
    """ms-swift's closing logging.jsonl record (both backends) names the last checkpoint."""
    try:
        rec = json.loads(jsonl_line)
    except ValueError:
        return False
    return isinstance(rec, dict) and "last_model_checkpoint" in rec


@dataclass
class AttemptWatch:
    """The running attempt: its launch, resume point and port, its journal row, what its output showed,
    and (once it failed) its crash and the decision taken. The supervisor's only per-attempt state."""

    n: int
    launched: Launched
    port: int
    resume: Resume | None
    row: Attempt                               # as recorded in the journal
    log: FileTail
    jsonl: FileTail
    prior_losses: dict[int, float]             # what earlier attempts logged, for the resume check
    first_step: int | None = None
    first_step_at: float | None = None         # wall clock, recorded
    last: Progress | None = None
    last_step_at: float | None = None          # wall clock, recorded
    last_step_mono: float | None = None        # monotonic, for hang detection
    hang_at: float | None = None
    crash: Crash | None = None
    decision: Decision | None = None
    first_logged: Progress | None = None       # first logging.jsonl step record of this attempt
    finished: bool = False                     # the trainer wrote its closing record
    bad: tuple[str, ...] = ()                  # the NaN/Inf line, once seen
    bad_step: int | None = None
    resume_checked: bool = False

    @classmethod
    def start(cls, n: int, launched: Launched, port: int, resume: Resume | None, output_dir: Path,
              row: Attempt) -> AttemptWatch:
        jsonl = output_dir / "logging.jsonl"
        return cls(n, launched, port, resume, row, FileTail(launched.log_path), FileTail(jsonl, from_end=True),
                   logged_losses(jsonl))

    @property
    def good_step_at_launch(self) -> int:
        return self.resume.step if self.resume else -1

    def gather(self, now: float, mono: float, drain: bool = False) -> list[Progress]:
        """Read what is new; returns the new step records (stdout first, then logging.jsonl)."""
        fresh: list[Progress] = []
        for line in self.log.lines(None if drain else 8 << 20):
            p = progress.parse_line(line)
            if p is not None:
                fresh.append(p)
                self._check(p, line)
        for line in self.jsonl.lines(None if drain else 8 << 20):
            if finished_record(line):
                self.finished = True
                continue
            p = progress.parse_jsonl_line(line)
            if p is not None:
                fresh.append(p)
                self.first_logged = self.first_logged or p
                self._check(p, line)
        for p in fresh:
            if self.last is None or p.step > self.last.step:
                self.last, self.last_step_at, self.last_step_mono = p, now, mono
            if self.first_step is None:
                self.first_step, self.first_step_at = p.step, now
        return fresh

    def _check(self, p: Progress, line: str) -> None:
        if progress.andon(p) and not self.bad:
            self.bad, self.bad_step = (line.strip()[:500],), p.step

    @property
    def done(self) -> bool:
        last = self.last
        return self.finished or (last is not None and last.max_steps is not None and last.step >= last.max_steps)
