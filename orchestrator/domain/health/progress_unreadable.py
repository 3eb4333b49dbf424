"""Output that is training progress but not understood: a line with a step counter and a loss that the
progress parser (progress.py) turned into no step record, as another ms-swift or Megatron version's format
would be. Such lines are still liveness: the trainer is training, so no hang verdict while they keep coming.
Pure.
"""
from __future__ import annotations

import re

from orchestrator.domain.health.detector import Detector, Snapshot
from orchestrator.domain.health.kinds import Finding
from orchestrator.types import HealthKind, Progress

# A counter: "step 10", "iteration: 10", "global_step/max_steps': '10/40'", "it 10", "epoch 0.5", "10/40".
_COUNTER = re.compile(r"(?i)\b(?:global_step|step|steps|iter|iteration|it|epoch)\b\W{0,4}\d|\b\d+\s*/\s*\d+\b")
# A loss with its value: "loss: 1.2", "'loss': '1.2'", "lm loss: 1.234E+00", "Loss=nan". Not "eval_loss",
# "train_loss" (summaries), "loss_scale", nor "validation loss at iteration 10".
_LOSS = re.compile(r"(?i)(?<![A-Za-z_])loss\b\W{0,4}(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan|inf)")
SAMPLE_CHARS = 300


def looks_like_progress(line: str) -> bool:
    """Whether a log line reads as a training step's progress: a step counter and a loss value."""
    if "oss" not in line and "OSS" not in line:  # most lines: a substring test before any regex
        return False
    return bool(_LOSS.search(line)) and bool(_COUNTER.search(line))


def unreadable(line: str, parsed: Progress | None) -> bool:
    """A line that looks like progress but from which the parser got no step record."""
    return parsed is None and looks_like_progress(line)


class UnreadableTracker:
    """One attempt's log lines: when the last progress-looking line came (liveness), and once `min_lines`
    progress-looking lines in a row were not understood, one progress_unreadable finding with a sample.
    A line the parser understood resets the run of unreadable ones."""

    def __init__(self, min_lines: int = 3) -> None:
        self.min_lines = min_lines
        self.alive_at: float | None = None   # when the last line that looks like progress came (parsed or not)
        self.unreadable = 0                  # progress-looking lines in a row with no step record
        self.total = 0                       # all of this attempt's
        self.reported = False

    def __call__(self, snap: Snapshot) -> list[Finding]:
        """The "line" detector's check: feed() on the snapshot's line."""
        f = None if snap.line is None else self.feed(snap.line, snap.now, snap.parsed)
        return [] if f is None else [f]

    def feed(self, line: str, now: float, parsed: Progress | None = None) -> Finding | None:
        """One log line and what the parser got from it; returns the finding the first time the run of unreadable
        lines reaches min_lines (once per attempt)."""
        if parsed is not None:
            self.alive_at, self.unreadable = now, 0
            return None
        if not looks_like_progress(line):
            return None
        self.alive_at = now
        self.unreadable += 1
        self.total += 1
        if self.reported or self.unreadable < self.min_lines:
            return None
        self.reported = True
        sample = line.strip()[:SAMPLE_CHARS]
        return Finding(HealthKind.PROGRESS_UNREADABLE, f"{self.unreadable} log lines in a row look like training progress (a "
                                            f"step counter and a loss) but yield no step record; they count as "
                                            f"liveness. Sample: {sample}",
                       details={"sample": sample, "lines": self.unreadable})


DETECTOR = Detector("progress_unreadable", "line", lambda start: UnreadableTracker(start.cfg.unreadable_lines))
