"""Overflow-skipped updates are not NaN (issue 35, item 1): domain/health/skipped_steps.py over real trainer lines
(tests/fixtures/progress/, sources in its sources.jsonl), the recipe's precision, the attempt's andon and the
metric."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from orchestrator.config import recipe as R
from orchestrator.config.schema import HealthSection
from orchestrator.domain.health.watch import HealthWatch
from orchestrator.domain.progress import parse_jsonl_line, parse_line
from orchestrator.domain.health.skipped_steps import SkippedSteps, fp16_run
from orchestrator.host.metrics import Metrics
from orchestrator.types import Progress, HealthKind

HERE = Path(__file__).parent / "fixtures" / "progress"


def records(name: str) -> list[tuple[str, Progress]]:
    parse = parse_jsonl_line if name.endswith(".jsonl") else parse_line
    out = []
    for line in (HERE / name).read_text(encoding="utf-8").splitlines():
        p = parse(line)
        if p is not None:
            out.append((line, p))
    return out


def verdicts(name: str, fp16: bool, max_in_row: int = 50) -> list[tuple[int, bool, int]]:
    s = SkippedSteps(fp16, max_in_row)
    return [(p.step, (c := s.observe(p)).andon, c.skipped) for _, p in records(name)]


# Megatron-LM BERT pretraining with --fp16 (NVIDIA/nccl#743): the first logged line, iteration 10, has no loss
# and `number of skipped iterations: 10` (the loss scale falling from 2^32 to its level): skipped, not NaN.
def test_megatron_fp16_warm_up_skips_are_recorded_not_an_andon():
    ((_, p),) = records("megatron_nccl_743_bert_skipped.txt")
    assert p.step == 10 and p.skipped == 10 and p.loss is None
    for fp16 in (True, False):   # the trainer says it skipped: that holds whatever the recipe says
        assert verdicts("megatron_nccl_743_bert_skipped.txt", fp16) == [(10, False, 10)]


def test_megatron_skips_that_persist_are_an_andon():
    (line, p), = records("megatron_nccl_743_bert_skipped.txt")
    s = SkippedSteps(True, max_in_row=30)
    # the same real line at the next log intervals, every iteration still skipped (the loss scale at its floor)
    checks = [s.observe(Progress(step=p.step + 10 * k, loss=None, skipped=10)) for k in range(4)]
    assert [c.andon for c in checks] == [False, False, False, True]
    assert checks[-1].run == 40 and "max_skipped_steps 30" in checks[-1].why
    # an update between (fewer skipped than the interval's iterations) ends the run
    s = SkippedSteps(True, max_in_row=30)
    steps = [Progress(step=10 * k, loss=7.0, grad_norm=3.0, skipped=n) for k, n in enumerate((10, 10, 2, 10, 10), 1)]
    assert [s.observe(q).andon for q in steps] == [False] * 5 and s.run == 22 and s.total == 42


# Megatron-DeepSpeed (bigscience-workshop/Megatron-DeepSpeed#396): `grad norm: nan` with `number of skipped
# iterations: 0`: the trainer applied the update, so it is NaN even in an fp16 run.
def test_megatron_nan_grad_norm_it_did_not_skip_is_an_andon_in_fp16_too():
    for fp16 in (True, False):
        assert [a for _, a, _ in verdicts("megatron_deepspeed_396_nan_grad.txt", fp16)] == [True, True, True]


# ms-swift 2.x logging.jsonl (modelscope/ms-swift#2436): step 8280 logs `"grad_norm": NaN` beside loss 2.23.
def test_swift_nan_grad_norm_with_a_finite_loss_is_a_skip_in_fp16_and_an_andon_otherwise():
    assert verdicts("swift_2436_logging_nan.jsonl", fp16=True) == [(8270, False, 0), (8275, False, 0),
                                                                      (8280, False, 1)]
    assert verdicts("swift_2436_logging_nan.jsonl", fp16=False) == [(8270, False, 0), (8275, False, 0),
                                                                       (8280, True, 0)]


# transformers Trainer dicts (SY-Xuan/Pink#6): `'loss': 0.0, 'grad_norm': nan` line after line. The Trainer's
# logging_nan_inf_filter leaves non-finite losses out of the logged mean, so 0.0 beside a NaN grad norm is a
# NaN loss: an andon at once, fp16 or not. (The dicts have no step field: numbered here as logged.)
def test_a_zero_loss_beside_a_nan_grad_norm_is_a_nan_loss():
    lines = [ln for ln in (HERE / "hf_pink_6_nan_grad.txt").read_text().splitlines() if "'grad_norm': nan" in ln]
    assert len(lines) >= 10
    s = SkippedSteps(fp16=True)
    rec = Progress(step=1, loss=0.0, grad_norm=math.nan)
    assert all("'loss': 0.0" in ln for ln in lines)
    check = s.observe(rec)
    assert check.andon and "left non-finite losses out" in check.why


def test_a_nan_loss_is_an_andon_whatever_the_precision():
    for fp16 in (True, False):
        assert SkippedSteps(fp16).observe(Progress(step=3, loss=math.nan, grad_norm=math.nan)).andon
        assert SkippedSteps(fp16).observe(Progress(step=3, loss=math.inf, grad_norm=1.0)).andon


def test_fp16_skips_in_a_row_become_an_andon_only_past_the_limit():
    s = SkippedSteps(True, max_in_row=3)
    seq = [s.observe(Progress(step=i, loss=2.0, grad_norm=math.nan)).andon for i in range(1, 5)]
    assert seq == [False, False, False, True]
    s = SkippedSteps(True, max_in_row=3)
    grads = [math.nan, math.nan, 1.2, math.inf, math.nan, 0.9, math.nan]
    assert not any(s.observe(Progress(step=i, loss=2.0, grad_norm=g)).andon for i, g in enumerate(grads, 1))
    assert s.total == 5
    # a repeated record (stdout and logging.jsonl report each step) counts once
    assert s.observe(Progress(step=7, loss=2.0, grad_norm=math.nan)).skipped == 0 and s.total == 5


@pytest.mark.parametrize("sets, fp16", [
    ([], False),                                                  # bfloat16, the default
    (['model.torch_dtype="float16"'], True),
    (['model.torch_dtype="float32"'], False),
    (["extra_args.fp16=true"], True),
    (['extra_args.fp16="true"'], True),
    (['model.torch_dtype="float16"', "extra_args.fp16=false"], False),
    (['model.torch_dtype="float16"', "extra_args.bf16=true"], False),
])
def test_the_recipe_says_whether_the_run_is_fp16(write_recipe, sets, fp16):
    assert fp16_run(R.load(write_recipe(), sets)) is fp16


def test_the_health_watch_warns_once_per_run_of_skips():
    w = HealthWatch(HealthSection(), fp16=True)
    grads = [1.0, math.nan, math.nan, 1.0, math.nan, 1.0]
    found = [f for i, g in enumerate(grads, 1) for f in w.observe(Progress(step=i, loss=2.0, grad_norm=g))]
    assert [(f.kind, f.first_step) for f in found] == [(HealthKind.SKIPPED_STEPS, 2), (HealthKind.SKIPPED_STEPS, 5)]
    assert found[0].record()["skipped"] == 1 and "fp16" in found[0].message
    # bf16: no skip, no warning (the andon is the attempt's)
    w = HealthWatch(HealthSection())
    assert not [f for i, g in enumerate(grads, 1) for f in w.observe(Progress(step=i, loss=2.0, grad_norm=g))]


def test_skipped_steps_are_counted_apart_from_nan_steps():
    m = Metrics(clock=lambda: 1000.0)

    def val(name: str) -> float:
        v = m.registry.get_sample_value(name)
        return 0.0 if v is None else v

    m.observe_progress(Progress(step=1, loss=2.0, grad_norm=math.nan), skipped=1)
    m.observe_progress(Progress(step=1, loss=2.0, grad_norm=math.nan), skipped=1)   # the jsonl repeat
    m.observe_progress(Progress(step=10, loss=None, skipped=10), skipped=10)
    assert val("orchestrator_skipped_steps_total") == 11 and val("orchestrator_nan_total") == 0
    m.observe_progress(Progress(step=11, loss=2.0, grad_norm=math.nan))              # not skipped: NaN
    assert val("orchestrator_nan_total") == 1
