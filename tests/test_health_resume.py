"""Divergence after a resume (orchestrator/domain/health/resume.py through HealthWatch): every redone step
against the earlier attempt's loss, and the first window after the resume point against the one before it,
also when nothing was redone (the field's crash right after a save, then wrong weights)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from health_series import real_csv

from orchestrator.domain.health.kinds import Finding
from orchestrator.config.schema import HealthSection
from orchestrator.domain import progress
from orchestrator.domain.health.resume import edge_jump, redone_mismatch, window_jump
from orchestrator.domain.health.watch import HealthWatch
from orchestrator.types import Progress, HealthKind

FIXTURES = Path(__file__).parent / "fixtures" / "health"
CFG = HealthSection()
TOL = 0.05  # checkpoint.resume_loss_tolerance's default


def steps(losses: list[float], start: int = 1) -> list[Progress]:
    return [Progress(step=start + i, loss=v, grad_norm=1.0) for i, v in enumerate(losses)]


def noisy(n: int, level: float, rel: float = 0.03, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, rel)) for _ in range(n)]


def resume(first: list[Progress], resume_step: int, second: list[Progress],
           history: bool = False) -> list[Finding]:
    """Attempt 1 logs `first`; attempt 2 resumes from `resume_step` and logs `second`. `history`: a supervisor
    restarted before attempt 2 sees attempt 1 only through logging.jsonl."""
    w = HealthWatch(CFG, TOL)
    w.attempt(None)
    for p in first:
        w.observe(p) if not history else None
    if history:
        w = HealthWatch(CFG, TOL)
    w.attempt(resume_step, first if history else None)
    return [f for p in second for f in w.observe(p)]


def test_the_real_demo_resume_raises_nothing():
    recs = [p for p in map(progress.parse_jsonl_line, (FIXTURES / "demo-crash-resume.logging.jsonl").read_text()
                                                       .splitlines()) if p is not None]
    cut = next(i for i in range(1, len(recs)) if recs[i].step <= recs[i - 1].step)  # the resumed attempt starts
    first, second = recs[:cut], recs[cut:]
    assert (first[-1].step, second[0].step) == (15, 11)
    assert resume(first, 10, second) == []
    assert resume(first, 10, second, history=True) == []


def real_attempts(name: str) -> tuple[list[Progress], list[Progress]]:
    """A logging.jsonl of two attempts: the first one's records and the resumed one's."""
    recs = [p for p in map(progress.parse_jsonl_line, (FIXTURES / name).read_text().splitlines()) if p is not None]
    cut = next(i for i in range(1, len(recs)) if recs[i].step <= recs[i - 1].step)
    return recs[:cut], recs[cut:]


def test_a_real_resume_from_wrong_weights_is_caught_at_the_first_redone_step():
    """The CPU demo resumed from checkpoint-10 on wrongly loaded weights (tests/support/perturb_resume.py,
    PERTURB_TARGET=model): the loss went from 7.3 to 16."""
    first, second = real_attempts("demo-wrong-weights-resume.logging.jsonl")
    f = resume(first, 10, second)[0]
    assert (f.kind, f.details["check"], f.last_step) == (HealthKind.RESUME_DIVERGENCE, "redone_step", 11)
    assert f.level == pytest.approx(7.308, abs=1e-3) and f.value == pytest.approx(15.95, abs=0.01)


def test_the_same_real_resume_with_nothing_redone_is_caught_at_the_resume_point():
    """The field's case: the crash came right after the save at step 10, so nothing is redone. Caught on the
    third step after the resume (issue 35: was the tenth, by the first window)."""
    first, second = real_attempts("demo-wrong-weights-resume.logging.jsonl")
    f = resume([p for p in first if p.step <= 10], 10, second)[0]
    assert (f.kind, f.details["check"], f.first_step, f.last_step) == (HealthKind.RESUME_DIVERGENCE, "resume_point", 11, 13)
    assert f.level == pytest.approx(7.3, abs=0.1) and f.value > 15  # the level at step 10, the median of 11-13


@pytest.mark.parametrize("resume_step", range(500, 6501, 500))
def test_a_faithful_resume_of_a_real_noisy_run_raises_nothing(resume_step):
    """A correct resume redoes the same steps with the same data: the real series itself, cut anywhere."""
    recs = real_csv("baize-tcm-lora-sft.csv")
    crashed_at = resume_step + 37  # 37 steps redone
    first = [p for p in recs if p.step <= crashed_at]
    second = [p for p in recs if p.step > resume_step]
    assert resume(first, resume_step, second) == []
    assert resume(first, resume_step, [p for p in second if p.step > crashed_at]) == []  # nothing redone


def test_nothing_redone_and_wrong_weights_the_field_case():
    """A crash right after the save at step 100 (nothing to redo); the resumed attempt's weights were wrongly
    reassembled: the loss climbs from 1.42 to ~2.5."""
    first = steps(noisy(100, 1.42))
    second = steps(noisy(40, 2.5, seed=2), start=101)
    found = resume(first, 100, second)
    f = found[0]  # the level shift is a loss_divergence too, a window later: the resume check comes first
    assert [g.kind for g in found] == [HealthKind.RESUME_DIVERGENCE, "loss_divergence"]
    assert f.details["check"] == "resume_point" and f.details["resume_step"] == 100
    assert (f.first_step, f.last_step, f.window) == (101, 103, 3)
    assert f.level == pytest.approx(1.42, rel=0.05) and f.value == pytest.approx(2.5, rel=0.05)
    assert f.value > f.threshold


def test_a_later_redone_step_that_differs_is_caught_not_only_the_first():
    first = steps(noisy(50, 2.0))
    redo = [p.loss for p in first[40:]]
    redo[2] *= 1.2  # step 43: the third redone step
    second = steps(redo, start=41) + steps(noisy(20, 2.0, seed=3), start=51)
    (f,) = resume(first, 40, second)
    assert (f.kind, f.details["check"], f.last_step, f.details["redone_compared"]) == (
        HealthKind.RESUME_DIVERGENCE, "redone_step", 43, 3)
    assert f.level == pytest.approx(first[42].loss) and f.value == pytest.approx(1.2 * first[42].loss)


def test_redone_steps_within_tolerance_raise_nothing():
    first = steps(noisy(50, 2.0))
    second = steps([p.loss * 1.01 for p in first[40:]], start=41) + steps(noisy(20, 2.0, seed=3), start=51)
    assert resume(first, 40, second) == []


def test_a_resumed_attempt_reports_once():
    first = steps(noisy(50, 2.0))
    second = steps([p.loss * 2 for p in first[40:]], start=41) + steps(noisy(30, 4.0, seed=3), start=51)
    found = [f.kind for f in resume(first, 40, second)]
    assert found[0] == HealthKind.RESUME_DIVERGENCE and found.count(HealthKind.RESUME_DIVERGENCE) == 1


@pytest.mark.parametrize("before,after,jump", [
    ([1.42] * 10, [2.5] * 10, True),
    ([1.42] * 10, [2.0] * 10, False),          # +41 %: under the 50 % default
    ([2.0] * 10, [1.0] * 10, False),           # a drop is no divergence
    ([0.05] * 10, [0.12] * 10, False),         # +140 % of a tiny loss, but under the 0.1 minimum rise
    ([1.0, 1.0], [5.0, 5.0], False),           # too few losses to have a level
    ([1.0] * 9 + [9.0], [1.1] * 9 + [9.0], False),  # one outlier each side: the median ignores it
])
def test_window_jump(before, after, jump):
    assert (window_jump(before, after, CFG.resume_level_tolerance, CFG.divergence_min_rise) is not None) is jump


@pytest.mark.parametrize("loss,earlier,mismatch", [
    (2.0, 2.0, False), (2.09, 2.0, False), (2.11, 2.0, True), (1.89, 2.0, True), (0.0, 0.0, False),
])
def test_redone_mismatch(loss, earlier, mismatch):
    assert redone_mismatch(loss, earlier, TOL) is mismatch


def test_a_resume_from_scratch_has_no_resume_check():
    first = steps(noisy(50, 2.0))
    w = HealthWatch(CFG, TOL)
    w.attempt(None)
    for p in first:
        w.observe(p)
    w.attempt(None)  # fresh: a new run, not a resume
    assert [f for p in steps(noisy(30, 5.0), start=1) for f in w.observe(p)] == []


def test_after_a_weights_only_resume_only_the_first_redone_step_must_match():
    """No optimizer state: the first redone step's loss is taken on the checkpoint's weights; later ones follow
    a fresh optimizer's updates and may differ. The first one differing is still caught."""
    first = steps(noisy(50, 2.0))
    later_differ = steps([first[40].loss] + [p.loss * 1.2 for p in first[41:]], start=41)
    first_differs = steps([first[40].loss * 1.2] + [p.loss for p in first[41:]], start=41)

    def run(second: list[Progress]) -> list[str]:
        w = HealthWatch(CFG, TOL)
        w.attempt(None)
        for p in first:
            w.observe(p)
        w.attempt(40, weights_only=True)
        return [f.details.get("check", "") for p in second for f in w.observe(p)]

    assert run(later_differ) == []
    assert run(first_differs) == ["redone_step"]


def test_after_a_rollback_the_diverged_steps_are_no_reference():
    """Rolled back to checkpoint 30 from a divergence with onset 35: this time training goes well. The steps
    31-34 are compared (they must match); 35 on, logged by the diverged attempt, are not."""
    good = noisy(80, 2.0)
    diverged = good[:34] + [4.0] * 26   # steps 35-60 diverged
    w = HealthWatch(CFG, TOL)
    w.attempt(None)
    for p in steps(diverged):
        w.observe(p)
    w.attempt(30, suspect_from=35)
    assert [f for p in steps(good[30:], start=31) for f in w.observe(p)] == []
    w.attempt(None)
    for p in steps(diverged):
        w.observe(p)
    w.attempt(30)  # without suspect_from the healthy redo would be called a resume divergence
    assert [f.kind for p in steps(good[30:], start=31) for f in w.observe(p)] == [HealthKind.RESUME_DIVERGENCE]


# Issue 35, item 2: the level at the resume point, so a jump early in a steep fine-tune is caught as late in it.
def steep(n: int, start: float = 2.6, end: float = 0.85, tau: float = 12.0, rel: float = 0.0,
          seed: int = 1) -> list[float]:
    """A fine-tune's early fall: start -> end with time constant tau (logged steps), optional relative noise."""
    import math
    rng = random.Random(seed)
    return [(end + (start - end) * math.exp(-k / tau)) * (1 + rng.gauss(0, rel)) for k in range(n)]


def test_a_jump_early_in_a_steep_fine_tune_is_caught_at_the_resume_point():
    """The issue's case: loss 0.91 at the save, 1.57 on the first step after (+72 %), then training pulls it
    back down. The window medians miss it (the ten before sit high on the fall); the resume point does not."""
    first = steps(steep(30, end=0.88, tau=7))
    assert first[-1].loss == pytest.approx(0.91, abs=0.02)
    after = [1.57, 1.49, 1.42, 1.33, 1.25, 1.18, 1.12, 1.07, 1.03, 1.0]
    before = [p.loss for p in first[-CFG.resume_window:]]
    assert window_jump(before, after, CFG.resume_level_tolerance, CFG.divergence_min_rise) is None  # the old check
    (f,) = [g for g in resume(first, 30, steps(after, start=31)) if g.kind == HealthKind.RESUME_DIVERGENCE]
    assert (f.details["check"], f.first_step, f.last_step) == ("resume_point", 31, 33)
    assert f.level == pytest.approx(0.91, abs=0.02) and f.value == pytest.approx(1.49)


def test_the_same_jump_late_in_the_run_is_caught_too():
    first = steps(steep(300, end=0.88, tau=7))
    after = [1.57, 1.49, 1.42, 1.33, 1.25, 1.18, 1.12, 1.07, 1.03, 1.0]
    assert [f.details["check"] for f in resume(first, 300, steps(after, start=301))
            if f.kind == HealthKind.RESUME_DIVERGENCE] == ["resume_point"]


@pytest.mark.parametrize("name, cuts", [
    # steep early fall and warm-up (the lr rises over the first steps) of a real batch-2 LoRA SFT run
    ("baize-tcm-lora-sft.csv", range(12, 200, 3)),
    # its epoch boundaries (743 steps an epoch: the loss drops when the data comes round again)
    ("baize-tcm-lora-sft.csv", [743 * e + d for e in range(1, 9) for d in (-2, 0, 2)]),
    # noisy small batches all through (per-step loss up to 2.5 x its median)
    ("baize-tcm-lora-sft.csv", range(250, 6600, 97)),
    # a real TinyLlama SFT run logged every 15 steps, 2 epochs, cut at every logged step
    ("tinyllama-sft.csv", None),
])
def test_a_faithful_resume_of_real_runs_raises_nothing_anywhere(name, cuts):
    """A faithful resume continues the real series itself: cut there, nothing redone (the resume-point check's
    false-alarm rows)."""
    recs = real_csv(name)
    points = [p.step for p in recs[3:-3]] if cuts is None else list(cuts)
    for cut in points:
        first = [p for p in recs if p.step <= cut]
        second = [p for p in recs if p.step > cut]
        assert [f for f in resume(first, cut, second[:30]) if f.kind == HealthKind.RESUME_DIVERGENCE] == [], cut


@pytest.mark.parametrize("rel, seed", [(0.0, 1), (0.05, 1), (0.15, 2), (0.3, 3), (0.3, 4)])
def test_a_faithful_resume_of_a_steep_noisy_curve_raises_nothing(rel, seed):
    curve = steep(80, rel=rel, seed=seed)
    for cut in range(10, 60, 2):
        found = resume(steps(curve[:cut]), cut, steps(curve[cut:], start=cut + 1))
        assert [f for f in found if f.kind == HealthKind.RESUME_DIVERGENCE] == [], cut


@pytest.mark.parametrize("before_steps, before, after, jump", [
    (range(1, 11), [2.0 - 0.1 * k for k in range(10)], [1.9, 1.85, 1.8], True),    # a fall to 1.1, then 1.85
    (range(1, 11), [2.0 - 0.1 * k for k in range(10)], [1.2, 1.1, 1.15], False),   # the fall levels off
    (range(1, 11), [1.0] * 10, [1.4, 1.45, 1.3], False),                           # +40 %: under 50 %
    (range(1, 11), [1.0, 1.6, 0.5, 1.4, 0.6, 1.5, 0.7, 1.3, 0.6, 1.0], [1.55, 1.6, 1.5], False),  # noise
    (range(1, 11), [1.0] * 9 + [0.2], [1.0, 1.0, 1.0], False),                    # one low outlier at the end
    (range(1, 3), [1.0, 1.0], [3.0, 3.0, 3.0], False),                             # too few before
])
def test_edge_jump(before_steps, before, after, jump):
    got = edge_jump(list(before_steps), before, after, CFG.resume_level_tolerance, CFG.divergence_min_rise)
    assert (got is not None) is jump
