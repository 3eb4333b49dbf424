"""What a save and a start cost, measured from what the trainer already writes. Pure.

Evidence, per attempt:
  start-up   launch -> the first step record (stdout dict or logging.jsonl), as the supervisor saw it.
  save       the step records around a save: the trainer logs step N, saves, then trains on, so the
             gap from record N to the next record, less the training steps in between, is what the
             save stopped training for (a merged copy included). Where no such gap was seen (the
             records arrived together, the attempt died in the save) the checkpoint's own file times
             stand in: first file written to last file written (a lower bound: it misses the first
             file's own write).
The times are when the supervisor read the lines (poll_s = 0.5 s by default): good to a second,
which is what a save of minutes and a start of minutes need.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from statistics import median

from orchestrator.domain.checkpoint_names import checkpoint_step

# Save lines that name a checkpoint directory: swift sft (`Saving model checkpoint to X`, once X is written),
# megatron sft 4.x (`Successfully saved Megatron model weights in `X`.` / `... `safetensors` model weights in
# `X`.`), and the closing `last_model_checkpoint: X` of both (often glued to the tqdm bar by \r).
SAVE_LINE = re.compile(r"Saving model checkpoint to (\S+)|Successfully saved .*? in `([^`]+)`"
                       r"|last_model_checkpoint: (\S+)")
# Megatron-LM's save lines (ms-swift 3.x megatron prints them, the path its checkpoint-N): the step is the
# iteration they name, the path may be any --save directory. `saving checkpoint at iteration N` starts the
# save right after iteration N's step, `successfully saved checkpoint from (older: at) iteration N` ends it,
# `scheduled an async checkpoint save at iteration N` hands it to the background. Loading lines (`loading
# checkpoint from X at iteration N`, `successfully loaded checkpoint ...`) and `saving dataloader checkpoint`
# are no save of this run.
MEGATRON_SAVE_LINE = re.compile(r"(?:\bsaving checkpoint at|successfully saved checkpoint (?:from|at)"
                                r"|scheduled an async checkpoint save at) iteration\s+(\d+)\s+to\s")


def saved_step(line: str) -> int | None:
    """The step of the checkpoint a save line names (checkpoint-N or checkpoint-N-merged, or Megatron's
    iteration N), else None."""
    if "checkpoint" not in line:  # most lines: a C substring test instead of a regex scan
        return None
    m = MEGATRON_SAVE_LINE.search(line)
    if m:
        return int(m.group(1))
    m = SAVE_LINE.search(line)
    if not m:
        return None
    return checkpoint_step(next(g for g in m.groups() if g is not None).rstrip(".`"))


def startup_seconds(launched_at: float, first_step_at: float | None) -> float | None:
    """Launch -> first step record; None before the first step (or for clocks that went backwards)."""
    if first_step_at is None or first_step_at < launched_at:
        return None
    return first_step_at - launched_at


def step_seconds(records: Sequence[tuple[int, float]], skip_after: Iterable[int] = ()) -> float | None:
    """Median seconds per step from (step, seen at) records in order, leaving out gaps that start at a
    save step (`skip_after`) and gaps of records read in the same pass (no timing in them)."""
    skip = set(skip_after)
    per = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(records)
           if s1 > s0 and t1 > t0 and s0 not in skip]
    return median(per) if per else None


def save_seconds_from_steps(records: Sequence[tuple[int, float]], save_step: int,
                            step_s: float | None) -> float | None:
    """What the save at `save_step` stopped training for: the gap from the record at save_step to the next
    record, less (steps between) x step_s. None when either record is missing, both were read in the same
    pass, or the step time is unknown. Never negative (a save faster than the timing resolution is 0)."""
    if step_s is None:
        return None
    at = {s: t for s, t in records}
    if save_step not in at:
        return None
    later = [(s, t) for s, t in records if s > save_step]
    if not later:
        return None
    nxt, t_next = min(later)
    gap = t_next - at[save_step]
    if gap <= 0:
        return None
    return max(0.0, gap - (nxt - save_step) * step_s)


def save_seconds_from_files(mtimes: Iterable[float]) -> float | None:
    """First file written to last file written of one checkpoint directory; None for fewer than two files."""
    times = sorted(mtimes)
    return times[-1] - times[0] if len(times) >= 2 else None


def save_seconds(from_steps: float | None, from_files: float | None) -> tuple[float, str] | None:
    """One save's cost and where it came from: the step gap (the whole pause) over the file times (a lower bound)."""
    if from_steps is not None:
        return from_steps, "step gap"
    if from_files is not None:
        return from_files, "file times"
    return None


def mean_save(rows: Iterable[tuple[float | None, int | None]]) -> tuple[float | None, int]:
    """(mean save seconds, count) over attempts' (save_s mean, save_count) pairs, weighted by count."""
    total, n = 0.0, 0
    for mean, count in rows:
        if mean is not None and count:
            total += mean * count
            n += count
    return (total / n if n else None), n
