"""What saves and starts cost (orchestrator/domain/costs.py): table tests of the pure measurements."""
from __future__ import annotations

import pytest

from orchestrator.domain import costs


@pytest.mark.parametrize("line, step", [
    ("[INFO:swift] Saving model checkpoint to /out/checkpoint-500", 500),
    ("Train:  20%|██ | 6/30 [00:00<00:00]\x1b[INFO:swift] Saving model checkpoint to /o/checkpoint-10", 10),
    ("[INFO:swift] Successfully saved Megatron model weights in `/out/checkpoint-200`.", 200),
    ("[INFO:swift] Successfully saved `safetensors` model weights in `/out/checkpoint-200-merged`.", 200),
    ("[2024-08-01] [Rank 0] Saving model checkpoint: /ckpt/global_step2000/mp_rank_00_model_states.pt", None),
    ("{'loss': '1.0', 'global_step/max_steps': '5/10'}", None),
    ("Saving model checkpoint to /out/v3/adapter", None),
])
def test_saved_step(line, step):
    assert costs.saved_step(line) == step


@pytest.mark.parametrize("launched, first, expected", [(100.0, 580.0, 480.0), (100.0, None, None), (100.0, 99.0, None)])
def test_startup_seconds(launched, first, expected):
    assert costs.startup_seconds(launched, first) == expected


# (step, seen at): 1 s per step, a 40 s pause after step 10 (the save), read in passes.
RECORDS = [(2, 2.0), (4, 4.0), (6, 6.0), (8, 8.0), (10, 10.0), (12, 52.0), (14, 54.0)]


@pytest.mark.parametrize("records, skip, expected", [
    (RECORDS, {10}, 1.0),
    (RECORDS, set(), 1.0),                          # the median shrugs off one save gap
    ([(1, 5.0), (9, 5.0)], set(), None),            # read in the same pass: no timing
    ([(10, 0.0), (12, 42.0)], {10}, None),          # only a save gap
    ([(1, 0.0), (3, 1.0), (4, 1.5)], set(), 0.5),
])
def test_step_seconds(records, skip, expected):
    assert costs.step_seconds(records, skip) == expected


@pytest.mark.parametrize("records, save_step, step_s, expected", [
    (RECORDS, 10, 1.0, 40.0),                       # 42 s gap - 2 steps of 1 s
    (RECORDS, 10, None, None),                      # no step time
    (RECORDS, 11, 1.0, None),                       # no record at the save step
    (RECORDS, 14, 1.0, None),                       # no record after it yet
    ([(10, 5.0), (12, 5.0)], 10, 1.0, None),        # read in one pass
    ([(10, 5.0), (12, 6.0)], 10, 1.0, 0.0),         # faster than the resolution: 0, never negative
])
def test_save_seconds_from_steps(records, save_step, step_s, expected):
    assert costs.save_seconds_from_steps(records, save_step, step_s) == expected


@pytest.mark.parametrize("mtimes, expected", [([3.0, 1.0, 7.5], 6.5), ([1.0], None), ([], None)])
def test_save_seconds_from_files(mtimes, expected):
    assert costs.save_seconds_from_files(mtimes) == expected


@pytest.mark.parametrize("steps, files, expected", [
    (40.0, 12.0, (40.0, "step gap")), (None, 12.0, (12.0, "file times")), (None, None, None), (0.0, 3.0, (0.0, "step gap")),
])
def test_save_seconds_prefers_the_step_gap(steps, files, expected):
    assert costs.save_seconds(steps, files) == expected


@pytest.mark.parametrize("rows, expected", [
    ([(10.0, 1), (40.0, 3)], (32.5, 4)), ([(None, None), (5.0, 0)], (None, 0)), ([], (None, 0)),
])
def test_mean_save_weighs_by_count(rows, expected):
    assert costs.mean_save(rows) == expected
