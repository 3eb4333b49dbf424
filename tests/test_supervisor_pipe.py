"""A supervised run whose trainer prints only Megatron-LM's pipe-separated iteration lines (ms-swift 3.x's
Megatron backend; the fake trainer's FAKE_FORMAT=pipe): steps counted, saves measured, no hang verdict."""
from __future__ import annotations

from pathlib import Path

from orchestrator.domain.progress import parse_line
from orchestrator.types import CrashClass, ExitCode
from supervised import attempts, events, fake_recipe, supervise

PIPE = {"FAKE_FORMAT": "pipe"}


def test_pipe_format_run_completes_with_steps_and_saves(tmp_path):
    # startup_timeout_s 3: a reader that saw no step would call this run hung within the test
    code, _ = supervise(fake_recipe(tmp_path, extra_env=PIPE, supervisor={"startup_timeout_s": 3}))
    assert code == ExitCode.OK
    out = tmp_path / "out"
    runs = attempts(out)
    assert len(runs) == 1
    run = runs[0]
    assert run.cls is None and run.hang_detected_at is None and run.exit_code == 0
    assert (run.start_step, run.end_step) == (0, 40)
    assert run.startup_s is not None and run.first_step_at is not None
    # the trainer printed the pipe format only: no dict, no logging.jsonl to count steps from
    log = Path(run.log_path).read_text()
    assert " iteration       40/      40 | consumed samples:" in log and "{'loss'" not in log
    assert "saving checkpoint at iteration      20 to " in log and " validation loss at iteration 20 |" in log
    assert not (out / "logging.jsonl").exists()
    assert [p.step for p in map(parse_line, log.splitlines()) if p is not None] == list(range(1, 41))
    saves = events(out, "save_seconds")
    assert sorted(e["data"]["step"] for e in saves) == [10, 20, 30]   # step 40's pause: no later step to end it
    assert run.save_count == 3 and run.save_s is not None
    assert not events(out, "hang")


def test_pipe_format_hang_is_still_a_hang(tmp_path):
    """The steps the pipe lines show are what the hang timer runs on: a trainer gone silent is stopped."""
    code, _ = supervise(fake_recipe(tmp_path, faults="nccl_timeout_hang@25", extra_env=PIPE))
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [r.cls for r in runs] == [CrashClass.NCCL_TIMEOUT_HANG, None]
    assert runs[0].end_step == 24 and runs[1].start_step == 20 and runs[1].end_step == 40


def test_pipe_format_nan_stops_the_line(tmp_path):
    """ms-swift 3.x prints a NaN loss as `lm loss: NAN` (and `grad norm: nan`): the andon fires."""
    code, _ = supervise(fake_recipe(tmp_path, faults="nan_loss@15", extra_env=PIPE))
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [r.cls for r in runs] == [CrashClass.NAN_LOSS, None]
    assert "lm loss: NAN" in runs[0].evidence[0]
