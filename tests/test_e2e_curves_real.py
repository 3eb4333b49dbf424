"""Real curves end to end (issue 35, item 4): a real supervisor runs the fake trainer logging a real run's loss
and grad norm (FAKE_CURVE: step k logs the k-th point of a tests/fixtures/curves series) and must do what the
replay of that series through the detectors (measure.py) says, through the parser, the loop and the judgement:
a healthy run finishes with no health event; a NaN stops the line at its step; a spike is a warning only."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from supervised import attempts, events, fake_recipe, health_events, supervise

from orchestrator.types import CrashClass, ExitCode, HealthKind

CURVES = Path(__file__).parent / "fixtures" / "curves"


def curve_run(tmp_path: Path, name: str, **kw) -> tuple[Path, dict]:
    """A fake-trainer recipe that logs the series `name`, one point a step, for as many steps as it has."""
    doc = json.loads((CURVES / name).read_text())
    recipe = fake_recipe(tmp_path, iterations=len(doc["points"]), extra_env={"FAKE_CURVE": str(CURVES / name)}, **kw)
    return recipe, doc


def step_of(doc: dict, step: int) -> int:
    """The fake trainer's step that logs the series' `step` (its 1-based position)."""
    return [p["step"] for p in doc["points"]].index(step) + 1


# fp16 LoRA SFT (186 logged steps, warm-up) and bf16 full SFT (128, held out): the detectors' false-alarm side
@pytest.mark.parametrize("name", ["tinyllama-finetune.json", "metamath.json"])
def test_a_healthy_real_curve_runs_to_the_end_with_no_health_event(tmp_path, name):
    recipe, doc = curve_run(tmp_path, name, save_steps=50)
    code, _ = supervise(recipe)   # healthy=True: any health event fails the test
    assert code == ExitCode.OK
    assert [a.cls for a in attempts(tmp_path / "out")] == [None]


def test_a_real_nan_stops_the_line_at_its_step_and_its_checkpoint_is_not_resumed(tmp_path):
    # nanoGPT#215 (GPT-2, --dtype=float16): the loss logs nan at iteration 3010, the 10th line, and stays nan;
    # the trainer goes on and saves checkpoint-10 after logging it. The relaunch logs the same curve: NaN again.
    recipe, doc = curve_run(tmp_path, "issue-nanogpt-215-fp16-nan.json", save_steps=5, state=False)
    onset = step_of(doc, doc["onset"])
    assert onset == 10
    code, _ = supervise(recipe)
    assert code == ExitCode.GAVE_UP
    runs = attempts(tmp_path / "out")
    assert [a.cls for a in runs] == [CrashClass.NAN_LOSS, CrashClass.NAN_LOSS]
    # the save after the NaN is never resumed from: the relaunch starts from the one before the onset
    assert runs[1].resumed_from == str(tmp_path / "out" / "checkpoint-5")
    assert health_events(tmp_path / "out") == []


def test_a_real_grad_norm_spike_is_warned_of_and_the_run_goes_on(tmp_path):
    # unsloth#5207 (Gemma LoRA, bf16): pre-clip grad norm ~1500 x its neighbours at the 9th line, loss healthy
    recipe, doc = curve_run(tmp_path, "issue-unsloth-5207-gradnorm-spike.json", save_steps=5)
    code, _ = supervise(recipe, healthy=False)
    assert code == ExitCode.OK
    found = health_events(tmp_path / "out")
    assert [(e["kind"], e["data"].get("last_step")) for e in found] == [(HealthKind.GRAD_NORM_SPIKE, 9)]
    # taken: "keep", or "training_over" where the pass that read the 9th line also saw the trainer finish
    assert found[0]["data"]["action"] == "warn" and found[0]["data"]["taken"] in ("keep", "training_over")
    assert [a.cls for a in attempts(tmp_path / "out")] == [None]
    # a warning keeps the checkpoints: the last one, after the spike, is published
    assert "published checkpoint-9" in events(tmp_path / "out", "synced")[-1]["message"]
