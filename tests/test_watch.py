"""`orchestrator watch` of a trainer started by hand (tests/support/by_hand.py: nohup ... > train.log 2>&1, its
own session, outside the orchestrator), against the fake trainer: real processes, a real journal, real
checkpoints. The trainer is SIGSTOPped at birth and continued once the watcher has attached (no race)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from by_hand import attach_watcher, kill_unseen, start_by_hand, start_reaped
from supervised import attempts, cli, events, fake_recipe, journal, supervise, wait_for

from orchestrator.types import AttemptKind, CrashClass

SLOW = {"FAKE_STEP_S": "0.05"}


def attach(tmp: Path, recipe: Path, procs: list, *args: str, **env: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Starts the trainer by hand, then the watcher; continues the trainer once the watcher attached."""
    trainer, _log = start_by_hand(recipe, **env)
    procs.append(trainer)
    w = attach_watcher(tmp, recipe, trainer.pid, procs, *args)
    return trainer, w


def state_of(out: Path) -> str:
    j = journal(out)
    try:
        return j.get_all()["state"]
    finally:
        j.close()


def out_of(w: subprocess.Popen, tmp: Path, timeout: float = 180) -> int:
    rc = w.wait(timeout)
    return rc


def test_a_normal_run_is_watched_to_its_end_with_no_advice(tmp_path, procs):
    """Steps, checkpoints and the closing state are seen as `run` sees them; nothing is advised."""
    r = fake_recipe(tmp_path, iterations=30, save_steps=10, extra_env=SLOW)
    _trainer, w = attach(tmp_path, r, procs)
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    out = tmp_path / "out"
    [a] = attempts(out)
    assert a.kind == AttemptKind.OBSERVED and a.end_step == 30 and a.cls is None and a.exit_code == 0
    assert a.pid == _trainer.pid and a.started_at == pytest.approx(psutil.Process(_trainer.pid).create_time(), abs=1)
    assert [e["message"] for e in events(out, "checkpoint")] == [f"verified checkpoint-{s}" for s in (10, 20, 30)]
    assert not events(out, "advice") and not events(out, "crash")
    assert events(out, "complete")
    status = cli("status", str(r), "--json")
    assert status.returncode == 0 and '"state": "completed"' in status.stdout and '"advice": []' in status.stdout
    hist = cli("history", str(r))
    assert hist.returncode == 0 and "observed" in hist.stdout


def test_a_kill_9_is_classified_and_advised_and_nothing_is_started(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=400, save_steps=10, extra_env={"FAKE_STEP_S": "0.02"})
    trainer, w = attach(tmp_path, r, procs)
    out = tmp_path / "out"
    assert wait_for(lambda: len(events(out, "checkpoint")) >= 2, 120, 0.05)
    os.kill(trainer.pid, signal.SIGKILL)
    assert out_of(w, tmp_path) == 3
    [a] = attempts(out)  # nothing launched
    assert a.kind == AttemptKind.OBSERVED and a.signal == 9 and a.cls is CrashClass.HOST_OOM_KILLED
    [adv] = events(out, "advice")
    assert adv["data"]["action"] == "relaunch" and adv["data"]["command"] == f"orchestrator run {r}"
    assert "would relaunch from checkpoint-" in adv["message"] and "after a verified wait" in adv["message"]
    assert "advice: " in (tmp_path / "watch.err").read_text()
    assert not list(out.glob(".orchestrator/attempts/attempt-*.log"))  # where a launch's output would go


def test_take_over_relaunches_from_the_newest_healthy_checkpoint_and_completes(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=40, save_steps=10, faults="nccl_error@25", extra_env=SLOW)
    _trainer, w = attach(tmp_path, r, procs, "--take-over")
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    out = tmp_path / "out"
    first, second = attempts(out)
    assert first.kind == AttemptKind.OBSERVED and first.cls is CrashClass.NCCL_ERROR
    assert second.n == 2 and second.kind == AttemptKind.TRAIN and second.resumed_from.endswith("checkpoint-20")
    assert second.end_step == 40
    assert [e["data"]["action"] for e in events(out, "advice")] == ["relaunch"]
    assert events(out, "take_over") and state_of(out) == "completed"


def test_a_stopped_trainer_is_advised_as_hung_and_left_alone(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=400, save_steps=10, extra_env={"FAKE_STEP_S": "0.02"},
                    supervisor={"hang_timeout_s": 3})
    trainer, w = attach(tmp_path, r, procs, "--take-over")
    out = tmp_path / "out"
    assert wait_for(lambda: len(events(out, "checkpoint")) >= 1, 120, 0.05)
    os.kill(trainer.pid, signal.SIGSTOP)
    assert wait_for(lambda: events(out, "advice"), 180, 0.1), (tmp_path / "watch.err").read_text()
    [adv] = events(out, "advice")
    assert adv["data"]["action"] == "kill_and_relaunch" and adv["message"].startswith("hung for ")
    assert adv["data"]["command"] == f"kill {trainer.pid} && orchestrator run {r}"
    assert psutil.Process(trainer.pid).status() == psutil.STATUS_STOPPED  # --take-over alone never kills
    assert w.poll() is None and len(attempts(out)) == 1
    w.send_signal(signal.SIGTERM)
    assert out_of(w, tmp_path) == 0
    assert psutil.Process(trainer.pid).status() == psutil.STATUS_STOPPED


def test_take_over_hang_stops_the_stopped_trainer_and_the_new_attempt_completes(tmp_path, procs):
    """--take-over=hang: the SIGSTOPped trainer is advised as hung, then stopped as `run` stops one (its group
    continued and SIGTERMed, SIGKILL after grace_s), and the run taken over from the newest verified checkpoint."""
    r = fake_recipe(tmp_path, iterations=400, save_steps=10, extra_env={"FAKE_STEP_S": "0.02"},
                    supervisor={"hang_timeout_s": 3})
    trainer, w = attach(tmp_path, r, procs, "--take-over=hang")
    out = tmp_path / "out"
    assert wait_for(lambda: len(events(out, "checkpoint")) >= 1, 120, 0.05)
    os.kill(trainer.pid, signal.SIGSTOP)
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    assert trainer.poll() is not None, "the hung trainer was stopped by the watcher"
    first, second = attempts(out)
    assert first.kind == AttemptKind.OBSERVED and first.cls is CrashClass.NCCL_TIMEOUT_HANG
    assert "no new training step" in first.evidence[0] and first.signal in (signal.SIGTERM, signal.SIGKILL)
    every = events(out)  # oldest first
    handed = next(i for i, e in enumerate(every) if e["kind"] == "take_over")
    newest = max(int(e["message"].rsplit("-", 1)[1]) for e in every[:handed] if e["kind"] == "checkpoint")
    assert second.n == 2 and second.kind == AttemptKind.TRAIN and second.cls is None and second.end_step == 400
    assert second.resumed_from == str(out / f"checkpoint-{second.start_step}") and second.start_step >= 10
    assert second.start_step == newest
    hung, ended = events(out, "advice")
    assert hung["data"]["action"] == "kill_and_relaunch" and hung["message"].startswith("hung for ")
    assert ended["data"]["action"] == "relaunch"
    assert [e["message"] for e in events(out, "take_over")][0].startswith("attempt 1 hung: stopping pid ")
    assert state_of(out) == "completed"


def test_a_run_health_stop_blocks_the_take_over(tmp_path, procs):
    """A loss over health.loss_max is advised as a stop; when the trainer then crashes, --take-over relaunches
    nothing (no automatic relaunch into a run health said to stop): the crash advised, exit 3."""
    r = fake_recipe(tmp_path, iterations=40, save_steps=10, faults="nccl_error@25", extra_env=SLOW,
                    health={"loss_max": 1.0})  # the fake's loss starts at 2.5 and ends near 0.9
    _trainer, w = attach(tmp_path, r, procs, "--take-over")
    assert out_of(w, tmp_path) == 3, (tmp_path / "watch.err").read_text()
    out = tmp_path / "out"
    [a] = attempts(out)  # nothing relaunched
    assert a.kind == AttemptKind.OBSERVED and a.cls is CrashClass.NCCL_ERROR
    stop, ended = events(out, "advice")
    assert stop["data"]["action"] == "stop" and "over the limit 1 (health.loss_max)" in stop["message"]
    assert stop["data"]["command"] == f"kill {_trainer.pid}"
    assert ended["data"]["action"] == "relaunch"
    [not_taken] = events(out, "take_over")
    assert not_taken["message"].startswith("not taken over: run health advised: would stop: loss_limit: loss 2.")
    assert state_of(out) == "gave_up"
    assert not list(out.glob(".orchestrator/attempts/attempt-*.log"))


def test_a_stale_save_is_advised_and_left_in_place(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=30, save_steps=10, extra_env={**SLOW, "FAKE_STALE_SAVE": "20"})
    _trainer, w = attach(tmp_path, r, procs)
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    [adv] = events(out, "advice")
    assert adv["data"]["action"] == "set_aside" and adv["message"].startswith("would set checkpoint-20 aside: ")
    [ev] = events(out, "checkpoint_unchanged")
    assert "left in place" in ev["message"]


def test_a_nan_is_advised_and_every_checkpoint_left_in_place(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=30, save_steps=10, faults="nan_loss@15", extra_env=SLOW)
    _trainer, w = attach(tmp_path, r, procs)
    assert out_of(w, tmp_path) == 3, (tmp_path / "watch.err").read_text()  # a NaN outranks the exit 0, as in run
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    alive, ended = events(out, "advice")
    assert alive["data"]["action"] == "kill_and_relaunch" and "NaN/Inf at step 15" in alive["message"]
    assert ended["data"]["action"] == "relaunch" and "would relaunch from checkpoint-10 " in ended["message"]
    assert [a.cls for a in attempts(out)] == [CrashClass.NAN_LOSS]
    assert not list((tmp_path / "persist").glob("*/checkpoint-20")) and not list((tmp_path / "persist").glob("*/checkpoint-30"))
    # `run` acts on the advice: the NaN's checkpoints set aside, the relaunch from checkpoint-10
    code, sup = supervise(r, healthy=False)
    assert code == 0 and attempts(out)[-1].resumed_from.endswith("checkpoint-10")


def attach_reaped(tmp: Path, recipe: Path, procs: list, *args: str, **env: str) -> tuple[int, subprocess.Popen]:
    """As attach, with the trainer under a parent that reaps it the moment it ends (a shell running it): the
    watcher never sees its exit status."""
    parent, pid = start_reaped(recipe, **env)
    procs.append(parent)
    w = attach_watcher(tmp, recipe, pid, procs, *args)
    return pid, w


def test_a_run_whose_shell_reaps_it_completes_with_no_advice(tmp_path, procs):
    """The exit status is unknown, and every step was logged: completed, exit 0, nothing advised."""
    r = fake_recipe(tmp_path, iterations=30, save_steps=10, extra_env=SLOW)
    pid, w = attach_reaped(tmp_path, r, procs)
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    out = tmp_path / "out"
    [a] = attempts(out)
    assert a.kind == AttemptKind.OBSERVED and a.pid == pid and a.end_step == 30 and a.cls is None
    assert not events(out, "advice") and not events(out, "crash") and events(out, "complete")


def test_a_kill_9_of_a_run_whose_shell_reaps_it_is_judged_without_its_exit_status(tmp_path, procs):
    """The status unknown, a log that ends mid-run in progress alone: judged as a SIGKILL (host_oom_killed), the
    relaunch advised; the evidence says what was known and what was judged."""
    r = fake_recipe(tmp_path, iterations=400, save_steps=10, extra_env={"FAKE_STEP_S": "0.02"})
    pid, w = attach_reaped(tmp_path, r, procs)
    out = tmp_path / "out"
    assert wait_for(lambda: len(events(out, "checkpoint")) >= 2, 120, 0.05)
    kill_unseen(pid, w.pid)
    assert out_of(w, tmp_path) == 3, (tmp_path / "watch.err").read_text()
    [a] = attempts(out)  # nothing launched
    assert a.kind == AttemptKind.OBSERVED and a.signal is None and a.exit_code is None
    assert a.cls is CrashClass.HOST_OOM_KILLED
    assert a.evidence[0].startswith(f"exit status unknown: pid {pid} was not started by the orchestrator")
    assert any(e.startswith("the trainer ended mid-run and its log says nothing of why: judged as a SIGKILL")
               for e in a.evidence), a.evidence
    [adv] = events(out, "advice")
    assert adv["data"]["action"] == "relaunch" and adv["message"].startswith(
        "the trainer ended (exit status unknown: not the watcher's child), classified host_oom_killed: would "
        "relaunch from checkpoint-"), adv
    assert not list(out.glob(".orchestrator/attempts/attempt-*.log"))


def test_a_crash_of_a_run_whose_shell_reaps_it_is_classified_from_its_log_and_taken_over(tmp_path, procs):
    r = fake_recipe(tmp_path, iterations=40, save_steps=10, faults="nccl_error@25", extra_env=SLOW)
    _pid, w = attach_reaped(tmp_path, r, procs, "--take-over")
    assert out_of(w, tmp_path) == 0, (tmp_path / "watch.err").read_text()
    first, second = attempts(tmp_path / "out")
    assert first.kind == AttemptKind.OBSERVED and first.cls is CrashClass.NCCL_ERROR  # its log says so
    assert second.kind == AttemptKind.TRAIN and second.resumed_from.endswith("checkpoint-20") and second.end_step == 40


def one_error(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("orchestrator: error: "), p.stderr
    return lines[0]


def test_bad_input_is_one_line_and_exit_2(tmp_path, procs):
    r = fake_recipe(tmp_path)
    assert "no running megatron/swift sft" in one_error(cli("watch", str(r)))
    assert "no running" in one_error(cli("watch", str(r), "--pid", str(os.getpid())))
    assert "recipe file not found" in one_error(cli("watch", str(tmp_path / "missing.toml")))
    first, _ = start_by_hand(r)
    procs.append(first)
    assert "cannot read" in one_error(cli("watch", str(r), "--log", str(tmp_path / "nope.log")))
    second, _ = start_by_hand(r)
    procs.append(second)
    line = one_error(cli("watch", str(r)))
    assert f"pids {first.pid}, {second.pid}" in line and "--pid" in line
    (tmp_path / "b").mkdir()
    other = fake_recipe(tmp_path / "b")
    assert "not to the recipe's run.output_dir" in one_error(cli("watch", str(other), "--pid", str(first.pid)))
    assert not events(tmp_path / "out")  # nothing opened
