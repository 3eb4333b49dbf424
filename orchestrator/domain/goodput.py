"""Goodput: how much of a run's wall-clock time advanced training that was kept.

Pure: no clock, no I/O. host/journal_goodput.py's goodput_of() reads the times the supervisor recorded in
the journal and hands them to this accounting (attempt_spans, account, summarize, attempt_times, window_end).

Definitions (after Google's ml-goodput-measurement; see shared/research/anchors.md §4)

    total_s       the accounting window: first launch (or `start`) -> now (or `end`)
    productive_s  time spent training whose result survives: first step -> last kept checkpoint
                  for an attempt that ended without completing; first step -> end for a completed
                  attempt or the attempt still running (its work is not lost yet)
    ratio         productive_s / total_s (0.0 for an empty window)

    lost[cause], with productive_s + sum(lost) == total_s:
    startup        launch -> the attempt's first training step (whole attempt if it never got one;
                   a hang before the first step is indistinguishable from a slow start and counts
                   here too)
    lost_progress  training after the last checkpoint of an attempt that did not complete: that
                   work is redone after the resume (ml-goodput: WASTED_PROGRESS_FROM_DISRUPTION)
    hang           last logged step -> hang detection (the trainer was alive but not advancing)
    cleanup        hang detection -> process exit, plus recorded kill / GPU-verification spans
    wait           recorded settle waits (wait_s, NCCL settle), crash-loop backoff, disk-space waits
    slow           recorded spans of kind "slow" (throughput_drop -> throughput_recovered, or the attempt's
                   end): training below the attempt's baseline speed. Taken out of productive time only:
                   a slow stretch later lost to a crash is lost_progress already, never counted twice
    other          time in the window that no span covers (supervisor down, pre-flight, gaps)

An attempt's `last_checkpoint_at` must be the save time of the newest checkpoint from that attempt
that the next resume actually used (a checkpoint that failed verification does not count): work
after it is what gets redone. Overlapping spans are resolved first-come (sorted by start), so no
second is counted twice.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from orchestrator.types import TERMINAL_STATES, Attempt, State

PRODUCTIVE = "productive"
# Label values of orchestrator_lost_seconds_total{cause}; the order is the display order.
LOST_CAUSES: tuple[str, ...] = ("startup", "lost_progress", "wait", "hang", "cleanup", "slow", "other")
# Span kinds the supervisor may record, and the cause each one is charged to.
KIND_CAUSE: dict[str, str] = {
    "startup": "startup",
    "lost_progress": "lost_progress",
    "wait": "wait",
    "backoff": "wait",
    "hang": "hang",
    "cleanup": "cleanup",
    "verify": "cleanup",
    "restore": "startup",     # copying the newest published checkpoint back onto a new machine
    "slow": "slow",           # overlays productive time (summarize), unlike the others
}
SLOW = "slow"
KINDS = frozenset({PRODUCTIVE, *KIND_CAUSE})


@dataclass(frozen=True)
class Span:
    """[start, end) spent on one kind of thing (see KINDS)."""

    start: float
    end: float
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown span kind {self.kind!r}; expected one of {sorted(KINDS)}")

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class AttemptTimes:
    """The timestamps of one trainer launch that goodput needs (all wall-clock seconds)."""

    launched_at: float
    ended_at: float | None = None           # None: still running
    first_step_at: float | None = None      # None: never reached a training step
    last_step_at: float | None = None       # the last logged step (start of a hang)
    last_checkpoint_at: float | None = None  # newest checkpoint of this attempt that a resume used
    hang_detected_at: float | None = None   # when the supervisor declared the trainer hung
    completed: bool = False                 # training finished: nothing after the last save is lost


@dataclass(frozen=True)
class Goodput:
    total_s: float
    productive_s: float
    lost: dict[str, float] = field(default_factory=dict)
    ratio: float = 0.0

    @property
    def badput_s(self) -> float:
        return sum(self.lost.values())


def _clamp(t: float | None, lo: float, hi: float) -> float | None:
    return None if t is None else min(max(t, lo), hi)


def attempt_spans(a: AttemptTimes, now: float) -> list[Span]:
    """Split one attempt into startup / productive / lost_progress / hang / cleanup spans."""
    start = a.launched_at
    end = max(start, a.ended_at if a.ended_at is not None else now)
    first = _clamp(a.first_step_at, start, end)
    if first is None:
        return [Span(start, end, "startup")]
    spans = [Span(start, first, "startup")]
    last_step = _clamp(a.last_step_at, first, end)
    hang_at = _clamp(a.hang_detected_at, first, end)
    train_end = end
    if hang_at is not None:
        hang_from = last_step if last_step is not None and last_step <= hang_at else hang_at
        train_end = hang_from
        spans += [Span(hang_from, hang_at, "hang"), Span(hang_at, end, "cleanup")]
    lost_work = a.ended_at is not None and not a.completed
    if lost_work:
        # Work after the kept checkpoint is redone after the resume; before it, it is kept.
        kept = _clamp(a.last_checkpoint_at, first, train_end)
        kept = first if kept is None else kept
        spans += [Span(first, kept, PRODUCTIVE), Span(kept, train_end, "lost_progress")]
    else:
        spans.append(Span(first, train_end, PRODUCTIVE))
    return [s for s in spans if s.seconds > 0]


def account(
    attempts: Iterable[AttemptTimes] = (),
    spans: Iterable[Span] = (),
    *,
    now: float,
    start: float | None = None,
    end: float | None = None,
) -> Goodput:
    """Goodput over [start, end] (default: the earliest span start -> now).

    `spans` are what happened between attempts (cleanup, verify, wait, backoff), as recorded.
    """
    all_spans: list[Span] = [s for a in attempts for s in attempt_spans(a, now)]
    all_spans += list(spans)
    lo = start if start is not None else min((s.start for s in all_spans), default=now)
    hi = max(lo, end if end is not None else now)
    return summarize(all_spans, lo, hi)


def summarize(spans: Sequence[Span], lo: float, hi: float) -> Goodput:
    """Charge each second of [lo, hi] to at most one span (earliest start wins); rest is `other`. Then
    the productive seconds that a `slow` span covers are charged to `slow` instead."""
    lost = dict.fromkeys(LOST_CAUSES, 0.0)
    productive = 0.0
    charged: list[tuple[float, float]] = []   # the productive seconds, as intervals in order
    cursor = lo
    for s in sorted((s for s in spans if s.kind != SLOW), key=lambda s: (s.start, s.end)):
        a, b = max(s.start, cursor, lo), min(s.end, hi)
        if b <= a:
            continue
        if s.kind == PRODUCTIVE:
            productive += b - a
            charged.append((a, b))
        else:
            lost[KIND_CAUSE[s.kind]] += b - a
        cursor = b
    lost[SLOW] = _covered(charged, [(s.start, s.end) for s in spans if s.kind == SLOW])
    productive -= lost[SLOW]
    total = hi - lo
    lost["other"] = max(0.0, total - productive - sum(v for k, v in lost.items() if k != "other"))
    return Goodput(total, productive, lost, productive / total if total > 0 else 0.0)


def _covered(intervals: Sequence[tuple[float, float]], cover: Iterable[tuple[float, float]]) -> float:
    """Seconds of the (disjoint) `intervals` inside the union of `cover` (which may overlap)."""
    merged: list[list[float]] = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in merged)


# ------------------------------------------------------------------------------------------ from the journal

# +5 s: in a journal without saved_at, a checkpoint saved just before a crash is verified by the scan after the exit.
VERIFY_LAG_S = 5.0


def saved_at(ckpt: dict) -> float | None:
    """When the trainer finished writing a checkpoint row's files (journals before saved_at: when verified)."""
    return ckpt.get("saved_at") or ckpt.get("verified_at")


def attempt_times(attempts: list[Attempt], ckpts: list[dict], completed: bool) -> list[AttemptTimes]:
    """Journal rows -> AttemptTimes. An attempt's kept checkpoint is the one the next attempt resumed
    from, dated by its save time: the work after it, up to the attempt's end, is redone."""
    out = []
    by_step = {c["step"]: c for c in ckpts if c["ok"] and saved_at(c)}
    # the training that completed is the last "train" attempt: the final export (checkpoint.merge = "final")
    # comes after it and trains nothing (no steps: its time is charged to startup)
    last_train = max((i for i, a in enumerate(attempts) if a.kind == "train"), default=len(attempts) - 1)
    for i, a in enumerate(attempts):
        end = a.ended_at
        mine = [c for c in by_step.values() if a.started_at <= (saved_at(c) or 0.0)
                and (end is None or (saved_at(c) or 0.0) <= end + (0.0 if c.get("saved_at") else VERIFY_LAG_S))]
        if i + 1 < len(attempts):  # the kept work is what the next attempt resumed from
            used = by_step.get(attempts[i + 1].start_step)
            mine = [used] if used in mine else []
        out.append(AttemptTimes(a.started_at, end, a.first_step_at, a.last_step_at,
                                max((t for c in mine if (t := saved_at(c)) is not None), default=None),
                                a.hang_detected_at,
                                completed and i == last_train))
    return out


def window_end(kv: dict, attempts: list[Attempt], spans: list[Span], now: float) -> float:
    """The end of the accounting window. A live run: now. A stopped or failed run: its last update.
    A completed run: when its work ended (last attempt exit or recorded span), so running
    `orchestrator run` again on it later (nothing to launch) adds no idle time."""
    state = kv.get("state")
    if state not in {s.value for s in TERMINAL_STATES}:
        return now
    updated = kv.get("updated_at") or now
    if state != State.COMPLETED.value:
        return updated
    ends = [a.ended_at for a in attempts if a.ended_at is not None] + [s.end for s in spans]
    return min(updated, max(ends)) if ends else updated
