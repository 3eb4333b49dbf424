"""Progress lines in ms-swift 4.x output formats (pastes from public threads: test_progress_real.py)."""
from __future__ import annotations

import math

import pytest

from orchestrator.domain.progress import (
    andon,
    from_record,
    is_bad_number,
    parse_jsonl_line,
    parse_line,
)
from orchestrator.types import Progress

NAN = float("nan")
INF = float("inf")

MEGATRON_1 = ("{'loss': 1.40617847, 'grad_norm': 0.38101375, 'learning_rate': 2e-05, 'load_balancing_loss': "
              "1.02934599, 'iteration': '1/400', 'elapsed_time': '41s', 'remaining_time': '4h 32m 49s', "
              "'memory(GiB)': 70.12, 'train_speed(s/it)': 41.002815}")
MEGATRON_5 = ("{'loss': 1.31874514, 'grad_norm': 0.29114506, 'learning_rate': 9.96e-05, 'load_balancing_loss': "
              "1.01877034, 'iteration': '5/400', 'elapsed_time': '2m 45s', 'remaining_time': '3h 37m 18s', "
              "'memory(GiB)': 71.3, 'train_speed(s/it)': 33.006614}")
SWIFT_T5 = ("{'loss': '7.43', 'grad_norm': '1.873', 'learning_rate': '9.973e-05', 'token_acc': '0', 'epoch': "
            "'0.003333', 'global_step/max_steps': '1/30', 'elapsed_time': '0s', 'remaining_time': '1s', "
            "'train_speed(s/it)': '0.02664'}")
SWIFT_T4 = ("{'loss': 1.58882141, 'grad_norm': 10.75, 'learning_rate': 1e-05, 'token_acc': 0.61763144, 'epoch': "
            "0.05, 'global_step/max_steps': '5/94', 'elapsed_time': '10s', 'remaining_time': '3m 2s', "
            "'memory(GiB)': 5.64, 'train_speed(s/it)': 1.98}")
TQDM = "Train:  33%|███▎      | 2/6 [00:00<00:00, 36.42it/s]"

GOOD = [
    ("megatron-1", MEGATRON_1, Progress(1, 400, 1.40617847, 0.38101375, 2e-05, 70.12, 41.002815)),
    ("megatron-5", MEGATRON_5, Progress(5, 400, 1.31874514, 0.29114506, 9.96e-05, 71.3, 33.006614)),
    ("megatron-runbook", ("{'loss': 0.143, 'grad_norm': 0.21, 'learning_rate': 5.5e-07, 'iteration': '400/426', "
                         "'memory(GiB)': 113.6, 'train_speed(s/it)': 4.6}"),
     Progress(400, 426, 0.143, 0.21, 5.5e-07, 113.6, 4.6)),
    ("swift-t5", SWIFT_T5, Progress(1, 30, 7.43, 1.873, 9.973e-05, None, 0.02664)),
    ("swift-t4", SWIFT_T4, Progress(5, 94, 1.58882141, 10.75, 1e-05, 5.64, 1.98)),
    ("tqdm-glued", TQDM + SWIFT_T5, Progress(1, 30, 7.43, 1.873, 9.973e-05, None, 0.02664)),
    ("tqdm-cr-glued", TQDM + "\r" + MEGATRON_5, Progress(5, 400, 1.31874514, 0.29114506, 9.96e-05, 71.3, 33.006614)),
    ("tqdm-after", MEGATRON_5 + "\r" + TQDM, Progress(5, 400, 1.31874514, 0.29114506, 9.96e-05, 71.3, 33.006614)),
    ("leading-space", "   " + SWIFT_T4 + "  \n", Progress(5, 94, 1.58882141, 10.75, 1e-05, 5.64, 1.98)),
    ("rank-prefix", "[rank7]: " + MEGATRON_1, Progress(1, 400, 1.40617847, 0.38101375, 2e-05, 70.12, 41.002815)),
    ("grad-norm-first", "{'grad_norm': 0.5, 'loss': 2.0, 'iteration': '3/9'}", Progress(3, 9, 2.0, 0.5)),
    ("no-grad-norm", "{'loss': 2.0, 'global_step/max_steps': '3/9'}", Progress(3, 9, 2.0)),
    ("int-loss", "{'loss': 2, 'iteration': '3/9'}", Progress(3, 9, 2.0)),
    ("percent", "{'loss': '2.5%', 'iteration': '3/9'}", Progress(3, 9, 2.5)),
    # ms-swift 1.x/2.x: the callback sets logs['global_step'] = state.global_step (no max steps); the keys as
    # its sft printed them, the values made up (no public paste of this form was found).
    ("swift1x-global-step", "{'loss': 1.9, 'acc': 0.6, 'learning_rate': 9.9e-05, 'epoch': 0.01, 'global_step': 5}",
     Progress(5, None, 1.9, None, 9.9e-05)),
    ("swift2x-global-step", ("{'loss': 1.2, 'acc': 0.7, 'grad_norm': 0.8, 'learning_rate': 9e-05, 'epoch': 0.1, "
                             "'global_step': 10}"), Progress(10, None, 1.2, 0.8, 9e-05)),
    # A paste that lost the dict's opening brace (real one: test_progress_real.py)
    ("brace-lost", "'loss': 1.0, 'grad_norm': 0.5, 'global_step/max_steps': '3/9'}", Progress(3, 9, 1.0, 0.5)),
    ("brace-lost-indented", "  'grad_norm': 0.5, 'loss': 1.0, 'iteration': '3/9'}  ", Progress(3, 9, 1.0, 0.5)),
    # Megatron-LM's pipe line (ms-swift 3.x megatron); real pastes in test_progress_real.py
    ("3x-megatron", " [2025-01-01 00:00:00] iteration 5/400 | consumed samples: 80 | lm loss: 1.3E+00 |",
     Progress(5, 400, 1.3)),
]


@pytest.mark.parametrize("line,expected", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_parse_line(line, expected):
    assert parse_line(line) == expected


BAD_NUMBERS = [
    # (line, loss check, grad_norm check)
    ("{'loss': nan, 'grad_norm': 0.5, 'iteration': '7/10'}", math.isnan, lambda g: g == 0.5),
    ("{'loss': 1.0, 'grad_norm': nan, 'iteration': '7/10'}", lambda x: x == 1.0, math.isnan),
    ("{'loss': inf, 'grad_norm': -inf, 'iteration': '7/10'}", lambda x: x == INF, lambda g: g == -INF),
    ("{'loss': -inf, 'grad_norm': inf, 'iteration': '7/10'}", lambda x: x == -INF, lambda g: g == INF),
    ("{'loss': nan, 'grad_norm': nan, 'iteration': '7/10'}", math.isnan, math.isnan),
    ("{'loss': 'nan', 'grad_norm': '1.0', 'global_step/max_steps': '7/10'}", math.isnan, lambda g: g == 1.0),
    ("{'loss': 'inf', 'grad_norm': '-inf', 'global_step/max_steps': '7/10'}", lambda x: x == INF,
     lambda g: g == -INF),
    ("{'loss': 'NaN', 'grad_norm': 'Infinity', 'global_step/max_steps': '7/10'}", math.isnan, lambda g: g == INF),
    ("{'loss':nan,'grad_norm':inf,'iteration':'7/10'}", math.isnan, lambda g: g == INF),
    (TQDM + "{'loss': nan, 'grad_norm': nan, 'iteration': '7/10'}", math.isnan, math.isnan),
]


@pytest.mark.parametrize("line,loss_ok,grad_ok", BAD_NUMBERS)
def test_parse_line_nan_inf(line, loss_ok, grad_ok):
    p = parse_line(line)
    assert p is not None and p.step == 7 and p.max_steps == 10
    assert loss_ok(p.loss) and grad_ok(p.grad_norm)
    assert andon(p)


NONE = [
    ("eval-megatron", ("{'eval_loss': 1.2518692, 'eval_load_balancing_loss': 1.0132046, 'iteration': '200/400', "
                      "'elapsed_time': '1h 50m 2s', 'remaining_time': '1h 50m 2s', 'memory(GiB)': 71.3, "
                      "'train_speed(s/it)': 33.010001}")),
    ("eval-swift", "{'eval_loss': '1.2', 'eval_runtime': '0.5', 'epoch': '1', 'global_step/max_steps': '10/30'}"),
    ("train-runtime", ("{'train_runtime': '0.5936', 'train_samples_per_second': '50.54', 'train_steps_per_second': "
                      "'50.54', 'train_loss': '7.354', 'epoch': '0.1', 'global_step/max_steps': '30/30', "
                      "'elapsed_time': '1s', 'remaining_time': '0s', 'train_speed(s/it)': '0.01976'}")),
    ("empty", ""),
    ("blank", "   \n"),
    ("info", "[INFO:swift] Saving model checkpoint to /out/checkpoint-10"),
    ("tqdm-only", TQDM),
    ("partial", "{'loss': 1.40617847, 'grad_norm': 0.38101375, 'learning_rate': 2e-05, 'iteration': '1/4"),
    ("partial-no-close", "{'loss': 1.4, 'iteration': '1/400'"),
    ("no-step", "{'loss': 1.4, 'grad_norm': 0.3}"),
    ("step-no-slash", "{'loss': 1.4, 'iteration': '5'}"),
    ("step-int", "{'loss': 1.4, 'iteration': 5}"),
    ("global-step-bool", "{'loss': 1.4, 'global_step': True}"),
    ("global-step-str", "{'loss': 1.4, 'global_step': '5'}"),
    ("brace-lost-eval", "'eval_loss': 1.2, 'global_step/max_steps': '10/30'}"),
    ("brace-lost-no-close", "'loss': 1.4, 'global_step/max_steps': '10/30'"),
    ("brace-lost-mid-line", "text 'loss': 1.4, 'global_step/max_steps': '10/30'}"),
    ("brace-lost-no-step", "'loss': 1.4, 'grad_norm': 0.3}"),
    ("brace-lost-tail", "'percentage': '11.70%', 'global_step/max_steps': '11/94'}"),
    ("step-garbage", "{'loss': 1.4, 'iteration': 'a/b'}"),
    ("step-none-total", "{'loss': 1.4, 'iteration': '5/None'}"),
    ("json-double-quotes", '{"loss": 1.4, "iteration": "5/400"}'),
    ("not-literal", "{'loss': __import__('os').system('true'), 'iteration': '1/2'}"),
    ("call", "{'loss': float('nan'), 'iteration': '1/2'}"),
    ("nested-brace", "{'loss': {'a': 1}, 'iteration': '1/2'}"),
    ("set-not-dict", "{'loss', 'iteration'}"),
    ("other-dict", "{'model_parameter_info': 'x', 'loss_scale': 1}"),
    ("last-checkpoint", "{'last_model_checkpoint': '/o/checkpoint-30', 'best_model_checkpoint': None}"),
    ("garbage", "\x00\x01\x02 }{ {'lo"),
    ("huge-garbage", "x" * 1_000_000),
    ("huge-braces", "{'loss" * 200_000),
    ("huge-partial", "{'loss': " + "1" * 1_000_000),
]


@pytest.mark.parametrize("line", [n[1] for n in NONE], ids=[n[0] for n in NONE])
def test_parse_line_none(line):
    assert parse_line(line) is None


def test_huge_valid_line():
    extra = ", ".join(f"'k{i}': {i}.5" for i in range(5_000))
    p = parse_line("{'loss': 1.5, " + extra + ", 'iteration': '9/10'}")
    assert p == Progress(9, 10, 1.5)


@pytest.mark.parametrize("line,expected", [
    (('{"loss": 7.43016481, "grad_norm": 1.87302744, "learning_rate": 9.973e-05, "token_acc": 0.0, "epoch": '
     '0.00333333, "global_step/max_steps": "1/30", "elapsed_time": "0s", "remaining_time": "1s", '
     '"train_speed(s/it)": 0.026642}'), Progress(1, 30, 7.43016481, 1.87302744, 9.973e-05, None, 0.026642)),
    ('{"loss": 1.3, "grad_norm": 0.2, "learning_rate": 1e-4, "iteration": "5/400", "memory(GiB)": 71.3}',
     Progress(5, 400, 1.3, 0.2, 1e-4, 71.3)),
    # ms-swift 1.x/2.x logging.jsonl: the same record as its stdout dict, `global_step` an int
    ('{"loss": 1.9, "acc": 0.6, "learning_rate": 9.9e-05, "epoch": 0.01, "global_step": 5}',
     Progress(5, None, 1.9, None, 9.9e-05)),
])
def test_parse_jsonl_line(line, expected):
    assert parse_jsonl_line(line) == expected


@pytest.mark.parametrize("line,loss,grad", [
    ('{"loss": NaN, "grad_norm": 1.0, "iteration": "3/9"}', "nan", 1.0),
    ('{"loss": Infinity, "grad_norm": -Infinity, "iteration": "3/9"}', INF, -INF),
    ('{"loss": 1.0, "grad_norm": NaN, "global_step/max_steps": "3/9"}', 1.0, "nan"),
])
def test_parse_jsonl_line_nan(line, loss, grad):
    p = parse_jsonl_line(line)
    assert p.step == 3
    for got, want in ((p.loss, loss), (p.grad_norm, grad)):
        assert math.isnan(got) if want == "nan" else got == want
    assert andon(p)


@pytest.mark.parametrize("line", [
    "", "not json", "[1, 2]", '"str"', "42", "null",
    '{"eval_loss": 1.2, "iteration": "200/400"}',
    '{"last_model_checkpoint": "/o/checkpoint-30", "best_model_checkpoint": null, "best_metric": null}',
    '{"train_runtime": 0.59, "train_loss": 7.3, "global_step/max_steps": "30/30"}',
    '{"loss": 1.0}',
    '{"loss": 1.0, "iteration": "x/y"}',
    '{"loss": 1.0, "iteration": ',
])
def test_parse_jsonl_line_none(line):
    assert parse_jsonl_line(line) is None


@pytest.mark.parametrize("rec,expected", [
    ({"loss": 1.0, "iteration": "1/2"}, Progress(1, 2, 1.0)),
    ({"loss": None, "grad_norm": 2.0, "iteration": "1/2"}, Progress(1, 2, None, 2.0)),
    ({"loss": True, "iteration": "1/2"}, Progress(1, 2, None)),
    ({"loss": "abc", "iteration": "1/2"}, Progress(1, 2, None)),
    ({"loss": 1.0, "iteration": "1/2", "global_step/max_steps": "3/4"}, Progress(3, 4, 1.0)),
    ({"eval_loss": 1.0, "iteration": "1/2"}, None),
])
def test_from_record(rec, expected):
    assert from_record(rec) == expected


@pytest.mark.parametrize("p,stop", [
    (Progress(1, 2, 1.0, 1.0), False),
    (Progress(1, 2, None, None), False),
    (Progress(1, 2, 0.0, 0.0), False),
    (Progress(1, 2, -5.0, 1e30), False),
    (Progress(1, 2, NAN, 1.0), True),
    (Progress(1, 2, 1.0, NAN), True),
    (Progress(1, 2, INF, 1.0), True),
    (Progress(1, 2, 1.0, -INF), True),
    (Progress(1, 2, None, INF), True),
    (Progress(1, 2, NAN, None, lr=1.0), True),
    (Progress(1, 2, 1.0, 1.0, lr=NAN), False),  # only loss and grad norm stop the line
])
def test_andon(p, stop):
    assert andon(p) is stop


@pytest.mark.parametrize("x,bad", [(None, False), (0.0, False), (1e308, False), (NAN, True), (INF, True),
                                   (-INF, True)])
def test_is_bad_number(x, bad):
    assert is_bad_number(x) is bad
