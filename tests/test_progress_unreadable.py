"""Progress lines the parser does not understand (orchestrator/domain/health/progress_unreadable.py): the predicate
over real formats, the real demo's stdout (nothing unreadable), and the tracker's once-per-attempt finding
and liveness."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.types import HealthKind
from orchestrator.config.schema import HealthSection
from orchestrator.domain import progress
from orchestrator.domain.health.watch import HealthWatch
from orchestrator.domain.health.progress_unreadable import UnreadableTracker, looks_like_progress, unreadable

FIXTURES = Path(__file__).parent / "fixtures"
MEGATRON = (" iteration      100/  500000 | consumed samples:       102400 | elapsed time per iteration (ms): 5120.3 |"
            " learning rate: 3.000E-04 | global batch size:  1024 | lm loss: 2.345678E+00 | grad norm: 1.234 |")

PROGRESS_LIKE = {
    "Megatron-LM's own iteration line": MEGATRON,
    "tqdm postfix with Loss": "Epoch 3:  45%|####5     | 1350/3000 [41:12<50:21,  1.83s/it, loss=2.31, v_num=12]",
    "an HF dict without global_step": "{'loss': 1.58, 'grad_norm': 0.868, 'learning_rate': 9.01e-06, 'epoch': 0.01}",
    "a plain step line": "step 312: loss 2.0871, lr 2.9e-04",
    "torchtune": "1|16|Loss: 2.572175979614258: 100%|#####| 16/16 [00:10<00:00]",
    "a NaN loss": "iteration 12/100 | lm loss: nan |",
}
NOT_PROGRESS = {
    "an eval record": "{'eval_loss': 1.62, 'eval_runtime': 311.1, 'epoch': 0.14, 'global_step/max_steps': '200/2800'}",
    "the closing summary": "{'train_runtime': 5980.7, 'train_loss': 0.973, 'epoch': 3.0}",
    "a loss scale": "iteration 5 | loss_scale: 1024.0",
    "a validation header": " validation loss at iteration 10 on validation set | lm loss PPL: 3.3 |",
    "a bar without a loss": "Train:  28%|##8       | 11/40 [00:00<00:00, 183.26it/s]",
    "a loss without a counter": "enable_channel_loss=False,",
    "an argument dump": "loss_type=None, loss_scale=default,",
}


@pytest.mark.parametrize("line", PROGRESS_LIKE.values(), ids=PROGRESS_LIKE.keys())
def test_lines_that_look_like_progress(line):
    assert looks_like_progress(line)
    assert unreadable(line, progress.parse_line(line)) is (progress.parse_line(line) is None)


@pytest.mark.parametrize("line", NOT_PROGRESS.values(), ids=NOT_PROGRESS.keys())
def test_lines_that_do_not(line):
    assert not looks_like_progress(line)


def test_the_real_demo_stdout_has_nothing_unreadable():
    lines = (FIXTURES / "health" / "demo-attempt-stdout.log").read_text(errors="replace").splitlines()
    parsed = [progress.parse_line(line) for line in lines]
    assert sum(p is not None for p in parsed) >= 20  # the steps of the resumed attempt
    assert [line for line, p in zip(lines, parsed) if unreadable(line, p)] == []
    w = HealthWatch(HealthSection())
    w.attempt(10)
    assert [f for line, p in zip(lines, parsed) for f in w.line(line, 1.0, p)] == []


def test_unparsed_progress_is_one_finding_with_a_sample_and_counts_as_liveness():
    t = UnreadableTracker(min_lines=3)
    found = [t.feed(MEGATRON, float(now)) for now in range(10)]
    (f,) = [x for x in found if x is not None]
    assert found[2] is f  # the third line in a row
    assert f.kind == HealthKind.PROGRESS_UNREADABLE and f.details["sample"] == MEGATRON.strip() and "lm loss" in f.message
    assert t.alive_at == 9.0


def test_a_parsed_record_resets_the_run_and_other_lines_are_no_liveness():
    t = UnreadableTracker(min_lines=3)
    assert t.feed(MEGATRON, 1.0) is None and t.feed(MEGATRON, 2.0) is None
    record = "{'loss': '7.3', 'grad_norm': '1.5', 'global_step/max_steps': '11/40'}"
    assert t.feed(record, 3.0, progress.parse_line(record)) is None
    assert t.feed(MEGATRON, 4.0) is None and t.feed(MEGATRON, 5.0) is None  # two in a row again
    assert t.feed("[INFO:swift] Saving model checkpoint", 6.0) is None
    assert t.alive_at == 5.0
    assert t.feed(MEGATRON, 7.0) is not None
