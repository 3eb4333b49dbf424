"""One attempt: tail its log and logging.jsonl and keep what was learnt (steps, losses, saves); record its
journal row and finish it once it ended.

AttemptWatch.gather is the reading half of a RUNNING pass (loop/running.py observes with it); the verdicts
(hang, NaN, resume divergence) are pure functions in domain/policy.py and domain/progress.py.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.domain import costs, progress
from orchestrator.domain.health.skipped_steps import SkippedSteps
from orchestrator.host.base import Host, Trainer
from orchestrator.host.journal import Journal
from orchestrator.host.launch.local import FileTail
from orchestrator.store import manifest
from orchestrator.store.checkpoints import logged_losses
from orchestrator.types import Attempt, Crash, Decision, Phase, Progress, Resume


def closing_record(jsonl_line: str) -> bool:
    """Tells whether a logging.jsonl line is ms-swift's closing record (both backends), which names the last
    checkpoint."""
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
    launched: Trainer
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
    longest_gap_s: float = 0.0                 # between two new step records (monotonic): the attempt's pace
    gaps: int = 0
    hang_timer_s: float | None = None          # the timer last applied (policy.hang_timeout)
    crash: Crash | None = None
    decision: Decision | None = None
    first_logged: Progress | None = None       # first logging.jsonl step record of this attempt
    closing_record_seen: bool = False          # the trainer wrote its closing logging.jsonl record
    bad: tuple[str, ...] = ()                  # the NaN/Inf line, once seen
    bad_step: int | None = None
    skips: SkippedSteps = field(default_factory=SkippedSteps)  # fp16 overflow-skipped updates: NaN only in a run
    skipped: dict[int, int] = field(default_factory=dict)     # step -> updates it skipped (for the metrics)
    resume_checked: bool = False
    # What saves and the start cost (costs.py): step records as first seen, saves not yet measured.
    output_dir: Path | None = None
    save_steps: int | None = None              # the interval this attempt was rendered with
    on_cost: Callable[[str, float, dict], None] | None = None  # ("startup" | "save", seconds, details)
    seen: list[tuple[int, float]] = field(default_factory=list)
    lines_read: list[tuple[str, Progress | None]] = field(default_factory=list)  # stdout lines not yet taken
    saves_read: list[int] = field(default_factory=list)    # steps save lines named, not yet taken
    saves_pending: set[int] = field(default_factory=set)
    saves: list[float] = field(default_factory=list)
    saves_measured: set[int] = field(default_factory=set)  # a save named again later (`last_model_checkpoint`, an
                                                            # async save's end line) is not measured twice

    @classmethod
    def start(cls, n: int, launched: Trainer, port: int, resume: Resume | None, output_dir: Path,
              row: Attempt, save_steps: int | None = None,
              on_cost: Callable[[str, float, dict], None] | None = None, fp16: bool = False,
              max_skipped_steps: int = 50) -> AttemptWatch:
        jsonl = output_dir / "logging.jsonl"
        return cls(n, launched, port, resume, row, FileTail(launched.log_path), FileTail(jsonl, from_end=True),
                   logged_losses(jsonl), output_dir=output_dir, save_steps=save_steps, on_cost=on_cost,
                   skips=SkippedSteps(fp16, max_skipped_steps, resume.step if resume else 0))

    @property
    def good_step_at_launch(self) -> int:
        return self.resume.step if self.resume else -1

    @property
    def clean_through(self) -> int:
        """The last step read without a NaN: a save after it may hold poisoned weights (retention waits)."""
        if self.bad_step is not None:
            return self.bad_step - 1
        return self.last.step if self.last else self.good_step_at_launch

    def gather(self, now: float, mono: float, drain: bool = False) -> list[Progress]:
        """Read what is new; returns the new step records (stdout first, then logging.jsonl). The stdout lines
        read, each with its record, and the steps save lines named are kept until take_read() (the health
        detectors read them, a drain's included)."""
        fresh: list[Progress] = []
        for line in self.log.lines(None if drain else 8 << 20):
            p = progress.parse_line(line)
            self.lines_read.append((line, p))
            if p is not None:
                fresh.append(p)
                self._check(p, line)
            else:
                saved = costs.saved_step(line)
                if saved is not None:
                    self.saves_read.append(saved)
                if saved is not None and saved > self.good_step_at_launch and saved not in self.saves_measured:
                    self.saves_pending.add(saved)
        for line in self.jsonl.lines(None if drain else 8 << 20):
            if closing_record(line):
                self.closing_record_seen = True
                continue
            p = progress.parse_jsonl_line(line)
            if p is not None:
                fresh.append(p)
                self.first_logged = self.first_logged or p
                self._check(p, line)
        for p in fresh:
            if self.last is None or p.step > self.last.step:
                if self.last_step_mono is not None:
                    self.longest_gap_s, self.gaps = max(self.longest_gap_s, mono - self.last_step_mono), self.gaps + 1
                self.last, self.last_step_at, self.last_step_mono = p, now, mono
            if self.first_step is None:
                self.first_step, self.first_step_at = p.step, now
                self._cost("startup", costs.startup_seconds(self.row.started_at, now), {})
            if not self.seen or p.step > self.seen[-1][0]:
                self.seen.append((p.step, now))
                if self.save_steps and p.step % self.save_steps == 0:
                    self.saves_pending.add(p.step)
        self._measure_saves()
        return fresh

    def _measure_saves(self) -> None:
        """Each save once a later step record shows how long training paused for it (else its files' times)."""
        if not self.saves_pending or not self.seen:
            return
        del self.seen[:-256]  # enough for the step time; a pass never needs older records
        newest = self.seen[-1][0]
        k = self.save_steps
        step_s = costs.step_seconds(self.seen, self.saves_pending | {s for s, _ in self.seen if k and s % k == 0})
        for s in sorted(x for x in self.saves_pending if x < newest):
            self.saves_pending.discard(s)
            self.saves_measured.add(s)
            d = self.output_dir / f"checkpoint-{s}" if self.output_dir else None
            files = _file_times(d) if d is not None else []
            got = costs.save_seconds(costs.save_seconds_from_steps(self.seen, s, step_s),
                                     costs.save_seconds_from_files(files))
            if got is not None:
                self.saves.append(got[0])
                self._cost("save", got[0], {"step": s, "source": got[1]})

    def _cost(self, kind: str, seconds: float | None, details: dict) -> None:
        if seconds is None:
            return
        if kind == "startup":
            self.row = replace(self.row, startup_s=round(seconds, 3))
        else:
            self.row = replace(self.row, save_s=round(sum(self.saves) / len(self.saves), 3), save_count=len(self.saves))
        if self.on_cost:
            self.on_cost(kind, seconds, details)

    def _check(self, p: Progress, line: str) -> None:
        check = self.skips.observe(p)
        if check.skipped:
            self.skipped[p.step] = check.skipped
            if len(self.skipped) > 4096:  # the metrics read them in the same pass; keep the newest
                del self.skipped[min(self.skipped)]
        if check.andon and not self.bad:
            self.bad, self.bad_step = (line.strip()[:500],), p.step

    def take_read(self) -> tuple[list[tuple[str, Progress | None]], list[int]]:
        """Returns the stdout lines (each with its record) and the save steps read since the last call."""
        read = self.lines_read, self.saves_read
        self.lines_read, self.saves_read = [], []
        return read

    @property
    def at_end(self) -> bool:
        """The trainer logged its last step, or wrote its closing record."""
        last = self.last
        return self.closing_record_seen or (last is not None and last.max_steps is not None
                                            and last.step >= last.max_steps)

    def record(self, journal: Journal, row: Attempt) -> None:
        """Records a new version of this attempt's journal row."""
        self.row = row
        journal.record_attempt(row)

    def finish(self, journal: Journal, host: Host, crash: Crash, stopped: bool = False) -> None:
        """Closes this attempt's journal row: its end, exit status, class (none when the orchestrator stopped
        it), evidence and the steps and times it reached."""
        host.wait_exit(self.launched, 10)  # the reaper records the exit status right after terminate()
        st = self.launched.status
        self.record(journal, replace(self.row, ended_at=host.now(), exit_code=st.code if st else None,
                                     signal=st.signal if st else None, cls=None if stopped else crash.cls,
                                     evidence=crash.evidence, end_step=self.last.step if self.last else None,
                                     first_step_at=self.first_step_at, last_step_at=self.last_step_at,
                                     hang_detected_at=self.hang_at))

    @property
    def phase(self) -> Phase:
        """Where a failure now would be: before the attempt's first training step, or in training."""
        return Phase.TRAINING if self.first_step is not None else Phase.STARTUP

    @property
    def open(self) -> bool:
        """The attempt's journal row is not finished yet."""
        return self.row.ended_at is None


def _file_times(checkpoint_dir: Path) -> list[float]:
    """mtimes of a checkpoint's files (not our manifest); [] when it is gone."""
    out = []
    try:
        for rel in manifest.list_files(checkpoint_dir):
            out.append(os.stat(checkpoint_dir / rel).st_mtime)
    except OSError:
        return []
    return out
