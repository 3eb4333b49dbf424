"""`orchestrator watch` of a real `swift sft` (ms-swift 4.6, LoRA on the tiny MoE, CPU, offline) started by hand:
`nohup swift sft ... > train.log 2>&1 &` in its own session, outside the orchestrator (tests/support/by_hand.py).

(a) a normal run: steps, losses and the Prometheus metrics seen, its checkpoints verified, completed, exit 0,
    no advice, nothing launched;
(b) the trainer's process group SIGKILLed mid-run (an OOM kill as the user sees it): classified, advised, exit 3,
    nothing launched, its checkpoints left in place; with its exit status read from the zombie (its parent reaps
    it late), and unknown (its parent, as a shell does, reaps it at once: judged from its log).

The trainer is SIGSTOPped at birth and continued once the watcher attached; where the test needs the run to stand
still at a step (to read the metrics, to kill it past a checkpoint), it SIGSTOPs the whole group there: no race.
"""
from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest
from by_hand import attach_watcher, kill_group, kill_unseen, start_by_hand, start_reaped
from supervised import attempts, cli, events, journal, wait_for
from swift_recipe import recipe_file

from orchestrator.host import trainer_find
from orchestrator.types import AttemptKind, CrashClass

pytestmark = [pytest.mark.swift,
              pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")]

SLOW_S = 600  # a swift start (torch, transformers, the dataset map) on a loaded 2-core machine: generous


def last_step(out: Path) -> int:
    """The newest step in the trainer's logging.jsonl (0 before any; a line being written is skipped)."""
    step = 0
    try:
        text = (out / "logging.jsonl").read_text()
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "global_step/max_steps" in rec:
            step = max(step, int(rec["global_step/max_steps"].split("/")[0]))
    return step


def attach(tmp: Path, r: Path, procs: list, *args: str, reaped: bool = False) -> tuple[int, subprocess.Popen]:
    """Starts `swift sft` by hand (stopped at birth; `reaped`: under a parent that reaps it at once), then the
    watcher; continues the trainer once attached. Returns the trainer's pid and the watcher."""
    if reaped:
        parent, pid = start_reaped(r)
        procs.append(parent)
    else:
        trainer, _log = start_by_hand(r)
        procs.append(trainer)
        pid = trainer.pid
    w = attach_watcher(tmp, r, pid, procs, *args)
    return pid, w


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def freeze_at(pid: int, out: Path, step: int) -> int:
    """SIGSTOPs the trainer's group once its logging.jsonl reaches `step`; returns the step it stood at."""
    assert wait_for(lambda: last_step(out) >= step or not running(pid), SLOW_S, 0.02)
    kill_group(pid, signal.SIGSTOP)
    assert running(pid), "the run ended before the step"
    return last_step(out)


def metric(port: int, name: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else None


def nothing_launched(out: Path) -> None:
    """No trainer writes to the run's output_dir any more (a SIGKILLed one within a bound: it dies when next
    scheduled), and no attempt log of a launch exists."""
    assert wait_for(lambda: trainer_find.find(out) == [], 60, 0.05), trainer_find.find(out)
    assert not list(out.glob(".orchestrator/attempts/attempt-*.log"))


def test_a_hand_started_swift_run_is_watched_to_its_end_with_no_advice(tiny, tmp_path, procs):
    r = recipe_file(tiny, tmp_path, "optim.iterations=20")
    out = tmp_path / "out"
    pid, w = attach(tmp_path, r, procs)
    trainer = procs[0]
    # mid-run, the watcher's Prometheus endpoint shows the step the trainer stands at, and its loss
    stood = freeze_at(pid, out, 5)
    port = journal_value(out, "metrics_port")
    assert wait_for(lambda: (metric(port, "orchestrator_training_step") or 0) >= stood, 120, 0.1), \
        (tmp_path / "watch.err").read_text()
    assert metric(port, "orchestrator_training_max_steps") == 20
    assert 0 < metric(port, "orchestrator_loss") < 100  # type: ignore[operator]
    assert metric(port, 'orchestrator_state{state="running"}') == 1
    kill_group(pid, signal.SIGCONT)

    assert w.wait(SLOW_S) == 0, (tmp_path / "watch.err").read_text()
    [a] = attempts(out)
    assert a.kind == AttemptKind.OBSERVED and a.pid == trainer.pid and a.cls is None
    assert a.end_step == 20 and a.log_path == str(out / "train.log")
    assert [e["message"] for e in events(out, "checkpoint")] == ["verified checkpoint-10", "verified checkpoint-20"]
    assert not events(out, "advice") and not events(out, "crash")
    assert events(out, "complete") and journal_value(out, "state") == "completed"
    # the last save is published (an earlier one only when a publishing round came before the next save)
    assert "checkpoint-20" in {p.name for p in (tmp_path / "persist").glob("*/checkpoint-*")}
    status = json.loads(cli("status", str(r), "--json").stdout)
    assert status["state"] == "completed" and status["advice"] == []
    assert trainer.wait(60) == 0  # the watcher left the trainer its own exit
    nothing_launched(out)


@pytest.mark.parametrize("reaped", [False, True], ids=["status_read", "status_unknown"])
def test_a_hand_started_swift_run_killed_with_sigkill_is_classified_and_advised(tiny, tmp_path, procs, reaped):
    r = recipe_file(tiny, tmp_path)
    out = tmp_path / "out"
    pid, w = attach(tmp_path, r, procs, reaped=reaped)
    stood = freeze_at(pid, out, 12)
    assert wait_for(lambda: events(out, "checkpoint") or w.poll() is not None, 120, 0.1)
    assert [e["message"] for e in events(out, "checkpoint")] == ["verified checkpoint-10"]
    if reaped:  # `kill -9 -PGID`, the swift launcher and its training process, reaped before the watcher looks
        kill_unseen(pid, w.pid)
    else:
        kill_group(pid, signal.SIGKILL)

    assert w.wait(SLOW_S) == 3, (tmp_path / "watch.err").read_text()
    [a] = attempts(out)
    assert a.kind == AttemptKind.OBSERVED and a.cls is CrashClass.HOST_OOM_KILLED
    assert a.signal == (None if reaped else 9)
    if reaped:  # judged from the log: it ends mid-run in progress lines alone
        assert any(e.startswith("the trainer ended mid-run and its log says nothing of why") for e in a.evidence)
    assert stood <= a.end_step < 20
    [adv] = events(out, "advice")
    assert adv["data"]["action"] == "relaunch" and adv["data"]["command"] == f"orchestrator run {r}"
    assert "would relaunch from checkpoint-10 after a verified wait" in adv["message"]
    assert f"advice: {adv['message']}" in (tmp_path / "watch.err").read_text()
    assert journal_value(out, "state") == "gave_up"
    assert (out / "checkpoint-10").is_dir()  # left in place, nothing renamed
    nothing_launched(out)


def journal_value(out: Path, key: str):
    j = journal(out)
    try:
        return j.get_all()[key]
    finally:
        j.close()
