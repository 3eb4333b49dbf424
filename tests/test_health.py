"""Run-health detectors (orchestrator/domain/health/loss.py, health_watch.py): spikes, divergence and absolute limits
over logged steps. Table tests: the rows that must raise, and the false-positive rows (real noisy SFT series,
warm-up, the LR schedule's end, eval records, save pauses, few steps, a fast early drop) that must not."""
from __future__ import annotations

import math
import random

import pytest

from orchestrator.domain.health.kinds import Finding
from orchestrator.config.schema import HealthSection
from orchestrator.domain import progress
from orchestrator.domain.health.loss import divergence_threshold, spike_threshold
from orchestrator.domain.health.watch import HealthWatch
from orchestrator.types import Progress, HealthKind
from health_series import FIXTURES, real_csv

DEFAULTS = HealthSection()


def real_jsonl(name: str) -> list[Progress]:
    """A logging.jsonl as the loop reads it: eval and summary records parse to nothing."""
    lines = (FIXTURES / name).read_text().splitlines()
    return [p for p in map(progress.parse_jsonl_line, lines) if p is not None]


def series(losses: list[float], grads: list[float] | None = None, start: int = 1, every: int = 1) -> list[Progress]:
    grads = grads or [1.0] * len(losses)
    return [Progress(step=start + i * every, loss=v, grad_norm=g, lr=1e-4) for i, (v, g) in enumerate(zip(losses, grads))]


def noisy(n: int, level: float, rel: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, rel)) for _ in range(n)]


def run(records: list[Progress], cfg: HealthSection = DEFAULTS) -> list[Finding]:
    w = HealthWatch(cfg)
    w.attempt(None)
    return [f for p in records for f in w.observe(p)]


def kinds(found: list[Finding]) -> list[str]:
    return [f.kind for f in found]


# --- false-positive rows: normal runs raise nothing ------------------------------------------------------

def _warmup() -> list[Progress]:
    # loss 10 -> 2 and grad norm 40 -> 1 within 30 steps, then noisy and flat: warm-up's fast early drop
    losses = [2 + 8 * math.exp(-i / 6) for i in range(30)] + noisy(100, 2.0, 0.05)
    grads = [1 + 39 * math.exp(-i / 5) for i in range(30)] + noisy(100, 1.0, 0.2, seed=2)
    return series(losses, grads)


def _lr_end() -> list[Progress]:
    # the schedule's end: loss flattening while lr -> 0, grad norms drifting up a little
    n = 200
    return [Progress(step=i + 1, loss=1.0 + 0.3 * math.exp(-i / 40) + 0.01 * math.sin(i), grad_norm=0.5 + i / 400,
                     lr=1e-4 * (1 - i / n)) for i in range(n)]


def _eval_and_save_records() -> list[Progress]:
    # logging.jsonl with an eval record every 20 steps and a save pause (train_speed jumps) every 50
    lines = []
    for i, v in enumerate(noisy(120, 1.5, 0.05), start=1):
        speed = 30.0 if i % 50 == 0 else 1.0
        lines.append(f'{{"loss": {v}, "grad_norm": 1.0, "learning_rate": 1e-4, "global_step/max_steps": "{i}/120", '
                     f'"train_speed(s/it)": {speed}}}')
        if i % 20 == 0:
            lines.append(f'{{"eval_loss": {3 * v}, "global_step/max_steps": "{i}/120"}}')
    return [p for p in map(progress.parse_jsonl_line, lines) if p is not None]


def _twice(records: list[Progress]) -> list[Progress]:
    # stdout and logging.jsonl both report every step
    return [p for p in records for _ in (0, 1)]


QUIET = {
    "real noisy LoRA SFT, batch 2, 9 epochs, 6687 steps": lambda: real_csv("baize-tcm-lora-sft.csv"),
    "real TinyLlama SFT, logged every 15 steps, evals apart": lambda: real_csv("tinyllama-sft.csv"),
    "real CPU demo, crash and resume in one logging.jsonl": lambda: real_jsonl("demo-crash-resume.logging.jsonl"),
    "real CPU demo, fast early drop then the LR schedule's end": lambda: real_jsonl("demo-lr5e-2-150steps.logging.jsonl"),
    "warm-up: loss and grad norm fall fast": _warmup,
    "the LR schedule's end: flat loss, lr -> 0": _lr_end,
    "eval records and save pauses in logging.jsonl": _eval_and_save_records,
    "few steps": lambda: series([7.4, 7.3, 9.0, 7.2, 7.1]),
    # early in an attempt, before the spike window fills: a 2.5 x bump is under the raised bar (10 x 20/8 for
    # grad norms, 3 x 20/8 for the loss)
    "an early bump, 8 steps in": lambda: series([2.0] * 8 + [5.0] + [2.0] * 30, [1.0] * 8 + [20.0] + [1.0] * 30),
    "each step reported twice (stdout and logging.jsonl)": lambda: _twice(series(noisy(200, 2.0, 0.05))),
    "logging_steps 10": lambda: series(noisy(200, 1.2, 0.08), every=10),
    "a loss near zero wobbling (memorised data)": lambda: series([0.01 + 0.02 * (i % 3) for i in range(300)]),
    "NaN and inf records (the andon's, not health's)": lambda: series([1.0] * 30 + [math.nan, math.inf] + [1.0] * 30),
}


@pytest.mark.parametrize("make", QUIET.values(), ids=QUIET.keys())
def test_normal_runs_raise_nothing_with_the_defaults(make):
    assert run(make()) == []


# --- rows that must raise ---------------------------------------------------------------------------------

def _spike_lasting(n: int) -> list[Progress]:
    losses = noisy(60, 2.0, 0.03) + [8.0] * n + noisy(60, 2.0, 0.03, seed=3)
    return series(losses)


def _field_divergence() -> list[Progress]:
    # the field's resume bug, as a level shift inside one attempt: 1.42 -> ~2.5, grad norms up
    return series(noisy(100, 1.42, 0.05) + noisy(100, 2.5, 0.05, seed=4),
                  noisy(100, 1.0, 0.1, seed=5) + noisy(100, 3.0, 0.1, seed=6))


def _creeping_with_grad_norms() -> list[Progress]:
    # the loss creeps up 35 % (under the 50 % tolerance) while grad norms triple: "trend up with it"
    return series(noisy(100, 1.4, 0.03) + [1.4 * (1 + 0.35 * min(1, i / 20)) for i in range(80)],
                  noisy(100, 1.0, 0.05, seed=7) + [1 + 2 * min(1, i / 20) for i in range(80)])


SPIKE_STEP = 61
RAISE = {
    "a loss spike": (lambda: _spike_lasting(1), DEFAULTS, [HealthKind.LOSS_SPIKE], SPIKE_STEP),
    "a spike lasting 3 steps is one event": (lambda: _spike_lasting(3), DEFAULTS, [HealthKind.LOSS_SPIKE], SPIKE_STEP),
    "a grad-norm spike": (lambda: series(noisy(60, 2.0, 0.03), noisy(30, 1.0, 0.1) + [60.0] + noisy(29, 1.0, 0.1)),
                          DEFAULTS, [HealthKind.GRAD_NORM_SPIKE], 31),
    "loss over health.loss_max": (lambda: series([2.0] * 30 + [11.0] + [2.0] * 30), HealthSection(loss_max=10),
                                  [HealthKind.LOSS_LIMIT, HealthKind.LOSS_SPIKE], 31),
    # 150 x the level of the ten steps before: a spike too, judged before the window fills (bar x 20/10)
    "grad norm over health.grad_norm_max": (lambda: series([2.0] * 40, [1.0] * 10 + [150.0] + [1.0] * 29),
                                            HealthSection(grad_norm_max=100),
                                            [HealthKind.GRAD_NORM_LIMIT, HealthKind.GRAD_NORM_SPIKE], 11),
    "an early spike, before the window fills": (lambda: series([2.0] * 40, [1.0] * 6 + [40.0] + [1.0] * 33),
                                                DEFAULTS, [HealthKind.GRAD_NORM_SPIKE], 7),
    "the field's divergence: 1.42 -> 2.5 and grad norms up": (_field_divergence, DEFAULTS, [HealthKind.LOSS_DIVERGENCE], None),
    # 16 x its level at step 17 (judged early: 16 steps in, bar 10 x 20/16), 14 x at step 41
    "real CPU demo at lr 3.0: its grad norm jumps 16 x at step 17 and 14 x at step 41": (
        lambda: real_jsonl("demo-lr3-100steps.logging.jsonl"), DEFAULTS,
        [HealthKind.GRAD_NORM_SPIKE, HealthKind.GRAD_NORM_SPIKE], None),
    "a creeping loss with grad norms up": (_creeping_with_grad_norms, DEFAULTS, [HealthKind.LOSS_DIVERGENCE], None),
}


@pytest.mark.parametrize("make,cfg,expected,at", RAISE.values(), ids=RAISE.keys())
def test_unhealthy_runs_raise_each_condition_once(make, cfg, expected, at):
    found = run(make(), cfg)
    assert sorted(kinds(found)) == sorted(expected)
    for f in found:
        assert f.kind in tuple(HealthKind) and f.message and f.last_step is not None
        assert f.first_step is not None and f.first_step <= f.last_step
        if at is not None:
            assert f.last_step == at


def test_divergence_finding_carries_its_numbers():
    (f,) = run(_field_divergence())
    # the level shift starts at step 101. The onset is the first step of the window whose level first crossed:
    # at most a window early, never after the shift (a rollback must go back before it)
    assert 101 - DEFAULTS.divergence_window <= f.first_step <= 101
    assert f.last_step - f.first_step >= DEFAULTS.divergence_window
    assert f.window == DEFAULTS.divergence_window
    assert f.level == pytest.approx(1.42, rel=0.05)          # the best level
    assert f.threshold == pytest.approx(divergence_threshold(f.level, 0.5, 0.1))
    assert f.value > f.threshold
    rec = f.record()
    assert {"first_step", "last_step", "window", "level", "threshold", "value"} <= set(rec)


def test_an_ongoing_divergence_is_one_event_and_a_new_one_after_recovery_another():
    losses = noisy(60, 1.0, 0.02) + noisy(80, 2.0, 0.02, seed=8) + noisy(80, 1.0, 0.02, seed=9) + noisy(80, 2.0, 0.02, seed=10)
    assert kinds(run(series(losses))) == [HealthKind.LOSS_DIVERGENCE, HealthKind.LOSS_DIVERGENCE]


def test_a_short_rise_is_no_divergence():
    # 15 logged steps at double the level: the median window never holds it long enough
    losses = noisy(100, 1.0, 0.02) + noisy(15, 2.0, 0.02, seed=11) + noisy(100, 1.0, 0.02, seed=12)
    assert HealthKind.LOSS_DIVERGENCE not in kinds(run(series(losses)))


def test_limits_fire_on_the_first_value_over_and_once_while_it_stays():
    cfg = HealthSection(loss_max=10)
    found = run(series([2.0] * 20 + [12.0] * 30 + [2.0] * 40 + [12.0]), cfg)
    assert [f.last_step for f in found if f.kind == HealthKind.LOSS_LIMIT] == [21, 91]


@pytest.mark.parametrize("history,value,spike", [
    ([2.0] * 20, 5.9, False),            # flat: the MAD is 0, the ratio bar (3x) decides
    ([2.0] * 20, 6.1, True),
    ([1.0, 3.0] * 10, 7.0, False),       # noisy: median 2, MAD 1: the MAD bar (2 + 10 x 1 = 12) decides
    ([1.0, 3.0] * 10, 12.5, True),
])
def test_spike_threshold_needs_both_bars(history, value, spike):
    _, threshold = spike_threshold(history, DEFAULTS.spike_mads, DEFAULTS.spike_min_ratio)
    assert (value > threshold) is spike


def test_a_new_attempt_from_scratch_forgets_the_run():
    w = HealthWatch(DEFAULTS)
    w.attempt(None)
    for p in series(noisy(100, 1.0, 0.02)):
        w.observe(p)
    assert w.loss_level == pytest.approx(1.0, rel=0.05)
    w.attempt(None)  # a fresh run (drift): a higher loss is no divergence from the old run's best
    assert w.loss_level is None
    assert [f for p in series(noisy(100, 3.0, 0.02)) for f in w.observe(p)] == []


def test_a_divergence_ongoing_across_a_resume_is_not_reported_again():
    """health.on_divergence = "warn": the run goes on diverging, crashes, resumes: still the same condition."""
    records = series(noisy(60, 1.0, 0.02) + noisy(100, 2.0, 0.02, seed=13))
    w = HealthWatch(DEFAULTS.model_copy(update={"on_divergence": "warn"}))
    w.attempt(None)
    first = [f.kind for p in records[:140] for f in w.observe(p)]
    w.attempt(130)
    second = [f.kind for p in records[130:] for f in w.observe(p)]
    assert (first, second) == ([HealthKind.LOSS_DIVERGENCE], [])


def test_a_rollback_before_the_onset_reports_a_recurrence():
    records = series(noisy(60, 1.0, 0.02) + noisy(100, 2.0, 0.02, seed=13))
    w = HealthWatch(DEFAULTS)
    w.attempt(None)
    (f,) = [f for p in records[:140] for f in w.observe(p)]
    w.attempt(50, suspect_from=f.first_step)  # the same data again: it diverges again
    assert [g.kind for p in records[50:] for g in w.observe(p)] == [HealthKind.LOSS_DIVERGENCE]


def test_a_divergence_the_loop_acts_on_is_found_again_when_it_persists_across_a_resume():
    """health.on_divergence = "stop" or "rollback": a relaunch from inside the condition finds it again (derived
    from the data, not a one-shot latch), so the recurrence rule and the stop apply to it."""
    records = series(noisy(60, 1.0, 0.02) + noisy(100, 2.0, 0.02, seed=13))
    w = HealthWatch(DEFAULTS.model_copy(update={"on_divergence": "rollback"}))
    w.attempt(None)
    first = [f.kind for p in records[:140] for f in w.observe(p)]
    w.attempt(130)
    second = [f.kind for p in records[130:] for f in w.observe(p)]
    assert (first, second) == ([HealthKind.LOSS_DIVERGENCE], [HealthKind.LOSS_DIVERGENCE])
