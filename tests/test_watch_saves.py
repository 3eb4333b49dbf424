"""The watch measures each save once from the save lines of every format (orchestrator/loop/attempt.py + costs.saved_step)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.host.launch.local import FileTail
from orchestrator.types import Attempt
from orchestrator.loop.attempt import AttemptWatch


def pipe(step: int, total: int = 40) -> str:
    """Megatron-LM's training_log line as ms-swift 3.x megatron prints it (real form: tests/fixtures/progress/)."""
    return (f" [2026-01-20 08:33:58] iteration {step:8d}/{total:8d} | consumed samples: {step * 8:12d} | "
            f"elapsed time per iteration (ms): 1000.0 | learning rate: 1.000000E-04 | global batch size:     8 | "
            f"lm loss: 1.180399E+00 | loss scale: 1.0 | grad norm: 1.105 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def watch(tmp: Path, save_steps: int | None = None) -> tuple[AttemptWatch, Path, list]:
    log = tmp / "train.log"
    log.write_text("")
    costs: list = []
    w = AttemptWatch(1, SimpleNamespace(log_path=log), 29500, None, Attempt(n=1, started_at=0.0), FileTail(log),
                     FileTail(tmp / "logging.jsonl"), {}, output_dir=tmp, save_steps=save_steps,
                     on_cost=lambda kind, s, d: costs.append((kind, s, d)))
    return w, log, costs


def append(log: Path, *lines: str) -> None:
    with log.open("a") as f:
        f.write("".join(line + "\n" for line in lines))


START = "saving checkpoint at iteration      10 to /out/checkpoint-10 in torch_dist format"
END = "  successfully saved checkpoint from iteration      10 to /out/checkpoint-10 [ t 1/1, p 1/1 ]"
ASYNC = "  [2026-01-20 08:41:02.2] scheduled an async checkpoint save at iteration      10 to /out"
LAST = "Train:  27%|██▋       | 11/40 [00:52<02:19,  4.80s/it]\r[INFO:swift] last_model_checkpoint: /out/checkpoint-10"


@pytest.mark.parametrize("save_lines,late_lines", [
    ((START, END), ()),                 # sync: both lines before the next step
    ((START,), (END,)),                 # the end line read in a later pass
    ((ASYNC,), (END, LAST)),            # async: the end line (and the closing name) long after
    ((END,), (LAST, START)),            # any order: one save
])
def test_save_lines_measure_the_pause_once(tmp_path, save_lines, late_lines):
    """No save_steps known: the save lines alone say step 10 was saved; the pause is the gap to step 11 less
    one step (1 s); naming the same save again later measures nothing more."""
    w, log, costs = watch(tmp_path)
    for step, t in ((8, 8.0), (9, 9.0), (10, 10.0)):
        append(log, pipe(step))
        w.gather(t, t)
    append(log, *save_lines)
    w.gather(10.5, 10.5)
    append(log, pipe(11))
    w.gather(51.0, 51.0)
    append(log, *late_lines, pipe(12))
    w.gather(52.0, 52.0)
    append(log, pipe(13))
    w.gather(53.0, 53.0)
    saves = [c for c in costs if c[0] == "save"]
    assert len(saves) == 1 and saves[0][2] == {"step": 10, "source": "step gap"}
    assert saves[0][1] == pytest.approx(40.0)
    assert w.row.save_count == 1 and w.last.step == 13 and w.last.step_s == 1.0


def test_save_of_an_earlier_attempt_is_not_this_attempts(tmp_path):
    """`last_model_checkpoint` may name a checkpoint saved before the resume: not a save of this attempt."""
    w, log, costs = watch(tmp_path)
    w.resume = SimpleNamespace(step=10)
    append(log, pipe(11), LAST, pipe(12), pipe(13))
    w.gather(1.0, 1.0)
    assert not w.saves_pending and not [c for c in costs if c[0] == "save"]


def test_the_lines_of_a_pass_and_of_its_drain_both_reach_the_health_detectors(tmp_path):
    """take_read() returns every line read since the last call, a drain's after a pass's: what an exited
    trainer wrote last is judged too."""
    w, log, _ = watch(tmp_path)
    append(log, pipe(1), START)
    w.gather(1.0, 1.0)
    append(log, pipe(2), "an unparsed line")
    w.gather(2.0, 2.0, drain=True)
    lines, saves = w.take_read()
    assert [line for line, _ in lines] == [pipe(1), START, pipe(2), "an unparsed line"]
    assert [p.step if p else None for _, p in lines] == [1, None, 2, None] and saves == [10]
    assert w.take_read() == ([], [])
