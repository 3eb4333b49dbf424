"""The demo as a guided first run: the recipe file it writes (taken by every other command), the
injected crash told at the step it really happened, goodput charging the redone steps, and the
next commands it prints, run as printed."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest


from orchestrator.ops import demo
from orchestrator.store.checkpoints import verify_merged
from orchestrator.host.journal_goodput import goodput_of
from orchestrator.config.recipe import load, recipe_hash
from supervised import cli, free_port_range, journal

PACKAGED = Path(demo.__file__).parents[1] / "data" / "demo-cpu.toml"


@pytest.mark.parametrize("value", ["plain", 'quote " and \\ back', "ünïcode\ttab", 1, -3, 0.0001, 2.5e20, True,
                                   False, [1, 2], ["a", "b"], [], {"A_B": "x", "with space": [1.5]}])
def test_toml_value_round_trips(value):
    assert tomllib.loads(f"v = {demo.toml_value(value)}")["v"] == value


def test_written_recipe_is_the_packaged_one_with_workdir_paths_and_overrides(tmp_path):
    overrides = ("optim.lr=2e-4", 'env.vars.EXTRA="1"', "optim.iterations=12")
    path = demo.write_recipe(PACKAGED, tmp_path, overrides)
    assert path == tmp_path / "demo-cpu.toml"
    r = load(path)
    assert (r.optim.lr, r.optim.iterations, r.env.vars["EXTRA"]) == (2e-4, 12, "1")
    assert r.env.vars["CUDA_VISIBLE_DEVICES"] == "", "the packaged recipe's own nested table survives"
    assert Path(r.model.path) == tmp_path / "tiny-moe" and r.data.dataset == [str(tmp_path / "data.jsonl")]
    assert Path(r.run.output_dir) == tmp_path / "run" / "out"
    assert Path(r.run.persistent_dir) == tmp_path / "run" / "persistent"
    # the same run as the packaged recipe given the same paths and overrides on the command line
    same = load(PACKAGED, [f"model.path={json.dumps(str(tmp_path / 'tiny-moe'))}",
                           f"data.dataset=[{json.dumps(str(tmp_path / 'data.jsonl'))}]", *overrides])
    assert recipe_hash(r) == recipe_hash(same)
    assert "--set optim.lr=2e-4" in path.read_text().splitlines()[0]


def test_next_steps_name_the_recipe_as_typed_from_here(tmp_path):
    text = demo.next_steps(tmp_path / "w x" / "demo-cpu.toml", tmp_path / "w x" / "report.html", tmp_path)
    assert "orchestrator status 'w x/demo-cpu.toml'" in text
    assert "orchestrator run 'w x/demo-cpu.toml'" in text and "'w x/report.html'" in text
    elsewhere = demo.next_steps(Path("/srv/demo/demo-cpu.toml"), Path("/srv/demo/r.html"), tmp_path)
    assert "orchestrator history /srv/demo/demo-cpu.toml" in elsewhere


def test_a_bad_set_fails_before_anything_is_built(tmp_path):
    p = cli("demo", "--workdir", str(tmp_path / "w"), "--set", "optim.lr=fast")
    assert p.returncode == 2, p.stderr
    assert "optim.lr" in p.stderr and not (tmp_path / "w").exists()


@pytest.mark.swift
@pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")
def test_demo_elsewhere_tells_the_crash_step_charges_the_redone_steps_and_its_next_commands_work(tmp_path):
    work, here = tmp_path / "elsewhere", tmp_path / "cwd"
    here.mkdir()
    lo, hi = free_port_range(20)
    p = cli("demo", "--workdir", str(work), "--crash-at", "13", "--set", "optim.iterations=30",
            "--set", 'metrics.listen="127.0.0.1:0"', "--set", "metrics.linger_s=0",
            "--set", f"supervisor.port_range=[{lo}, {hi}]", cwd=here, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = work / "run" / "out"
    # the injected crash is in the demo's own node history, not the machine's (conftest's ORCHESTRATOR_NODE_STATE_DIR)
    (demo_run,) = json.loads((work / "node-state" / "node.json").read_text())["runs"].values()
    assert demo_run["failures"] == 1
    assert not (Path(os.environ["ORCHESTRATOR_NODE_STATE_DIR"]) / "node.json").exists()
    j = journal(out)
    try:
        first, second, export = j.attempts()  # the demo's checkpoint.merge = "final": the export comes last
        kept = next(c for c in j.checkpoints() if c["step"] == second.start_step)
        g = goodput_of(j)
        # checkpoint health (issue 23): a normal run's real checkpoints are neither stale nor non-finite
        assert not [e for e in j.events(1000) if e["kind"] in ("checkpoint_unchanged", "checkpoint_nonfinite")]
        assert all(c["ok"] for c in j.checkpoints()) and not list(out.glob("checkpoint-*.checkpoint_*"))
    finally:
        j.close()

    # the demo ends with the real `swift export` of its last checkpoint, verified and published
    assert export.kind == "export" and export.cls is None and export.resumed_from == str(out / "checkpoint-30")
    (merged,) = (work / "run" / "persistent").glob("*/checkpoint-30-merged")
    assert verify_merged(merged).ok

    # the console names the step the SIGKILL really hit: the killed attempt's last step
    told = re.search(r"demo: injected SIGKILL into the trainer .* at step (\d+)", p.stdout)
    assert told and int(told.group(1)) == first.end_step >= 13, p.stdout
    # ... and the machine's truth about it: no kernel OOM record (or the kernel log could not be read), never "an OOM"
    assert re.match(r"SIGKILL; (?:no kernel OOM record|kernel OOM records not available)", first.evidence[0]), first.evidence
    assert "oom killer killed" not in p.stdout.lower() and first.system is not None
    # the redone steps (after the kept checkpoint, up to the kill) are charged from the checkpoint's save time
    assert first.end_step > second.start_step == 10
    assert kept["saved_at"] < kept["verified_at"]
    # (from the save, or from the first step seen when the supervisor saw it only after the save: before it is startup)
    assert g.lost["lost_progress"] == pytest.approx(first.ended_at - max(kept["saved_at"], first.first_step_at), abs=0.01)
    assert g.lost["lost_progress"] > 0  # 3+ tiny-model steps: 0.04-0.1 s, so no firmer floor (CI saw 0.039)

    # the next commands, as printed, work from where the demo ran
    commands = {line.split()[1]: shlex.split(line.split("  #")[0]) for line in p.stdout.splitlines()
                if line.startswith("  orchestrator ")}
    assert {"status", "history", "report", "run"} <= commands.keys()
    assert commands["status"][2] == str(work / "demo-cpu.toml")
    assert str(out / ".orchestrator" / "report.html") in p.stdout
    h = cli(*commands["history"][1:], "--json", cwd=here)
    assert h.returncode == 0, h.stderr
    assert [a["end_step"] for a in json.loads(h.stdout)["attempts"]] == [first.end_step, 30, None]
    s = cli(*commands["status"][1:], "--json", cwd=here)
    assert s.returncode == 0 and json.loads(s.stdout)["state"] == "completed", s.stderr
    rep = cli(*commands["report"][1:], cwd=here)
    assert rep.returncode == 0 and (out / ".orchestrator" / "report.html").is_file(), rep.stderr
    again = cli(*commands["run"][1:], cwd=here)
    assert again.returncode == 0, again.stderr
    j = journal(out)
    try:
        assert len(j.attempts()) == 3, "a completed run relaunches nothing"
        assert goodput_of(j).total_s == pytest.approx(g.total_s), "and adds no idle time"
    finally:
        j.close()


def test_the_demo_keeps_its_node_history_apart_from_the_machines(tmp_path, monkeypatch):
    """The injected SIGKILL is recorded in the demo's own node history, never in the machine's: a later real run's
    save_steps = "auto" (and `plan`) read the machine's and would count the demo's crash as this node's."""
    import os

    from click.testing import CliRunner

    from orchestrator.host.node_history import NodeHistory
    from orchestrator.ops import cli, tiny
    from orchestrator.types import ExitCode

    machine = Path(os.environ["ORCHESTRATOR_NODE_STATE_DIR"])  # conftest: a temporary "machine" directory
    seen = {}

    class Ran:
        def __init__(self, recipe):
            self.recipe = recipe

    def supervise(r, on_start=None):  # the supervisor records its run's failures as save_interval.py does
        on_start(Ran(r))
        history = NodeHistory()
        seen["path"] = history.path
        assert history.record("demo-cpu-run", 1, 0.01, 1.0) is None
        return ExitCode.OK

    monkeypatch.setattr(tiny, "build", lambda workdir: workdir.mkdir(parents=True, exist_ok=True))
    monkeypatch.setattr(cli, "supervise", supervise)
    monkeypatch.setattr(demo, "inject_kill", lambda sup, step, say, then: None)
    r = CliRunner().invoke(cli.main, ["demo", "--workdir", str(tmp_path / "w")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert seen["path"] == tmp_path / "w" / "node-state" / "node.json"
    assert json.loads(seen["path"].read_text())["runs"]["demo-cpu-run"]["failures"] == 1
    assert not (machine / "node.json").exists()


@pytest.mark.swift
@pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")
def test_demo_watch_starts_the_trainer_by_hand_advises_the_kill_and_takes_over(tiny, tmp_path):
    """`demo --watch`: the trainer started with nohup in its own session, watched; the SIGKILL classified and
    advised by the watcher (attempt 1, observed), then the run taken over and completed (attempt 2, train)."""
    from orchestrator.host import trainer_find

    work = tmp_path / "w"
    shutil.copytree(tiny["model"], work / "tiny-moe")  # built once per session (tiny.build skips a built one)
    shutil.copy(tiny["data"], work / "data.jsonl")
    lo, hi = free_port_range(20)
    p = cli("demo", "--watch", "--workdir", str(work), "--crash-at", "13", "--set", "optim.iterations=30",
            "--set", 'checkpoint.merge="never"', "--set", 'metrics.listen="127.0.0.1:0"',
            "--set", "metrics.linger_s=0", "--set", f"supervisor.port_range=[{lo}, {hi}]", cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = work / "run" / "out"
    j = journal(out)
    try:
        watched, resumed = j.attempts()
        advice = [e for e in j.events(1000) if e["kind"] == "advice"]
        take_over = [e for e in j.events(1000) if e["kind"] == "take_over"]
        state = j.get_all()["state"]
    finally:
        j.close()
    # started by hand: the console shows the nohup command, and the observed attempt is that process
    started = re.search(r"demo: started the trainer by hand, as you would \(pid (\d+)\)", p.stdout)
    assert started and int(started.group(1)) == watched.pid, p.stdout
    assert f"nohup swift sft --model {work / 'tiny-moe'}" in p.stdout and "> train.log 2>&1 &" in p.stdout
    assert watched.kind == "observed" and watched.log_path == str(out / "train.log")
    # the kill: told at the step it hit, classified from the zombie's status, advised, then taken over
    told = re.search(r"demo: injected SIGKILL into the trainer .* at step (\d+)", p.stdout)
    assert told and int(told.group(1)) == watched.end_step >= 13, p.stdout
    assert "The watcher now classifies the crash" in p.stdout
    assert watched.signal == 9 and watched.cls.value == "host_oom_killed"
    [adv] = advice
    assert adv["data"]["action"] == "relaunch" and "would relaunch from checkpoint-10" in adv["message"]
    assert f"advice: {adv['message']}" in p.stderr and "taking over" in p.stderr
    assert take_over and resumed.n == 2 and resumed.kind == "train"
    assert resumed.resumed_from == str(out / "checkpoint-10") and resumed.end_step == 30 and resumed.cls is None
    assert state == "completed" and (out / "checkpoint-30").is_dir()
    assert trainer_find.find(out) == []  # nothing left running
    # the next commands work on the watched-then-supervised run
    s = cli("history", str(work / "demo-cpu.toml"), "--json")
    assert s.returncode == 0 and [a["kind"] for a in json.loads(s.stdout)["attempts"]] == ["observed", "train"]


def test_end_by_hand_kills_a_trainer_still_running_with_its_group_and_reaps_a_finished_one():
    """The demo's hand-started trainer is never left running: an interrupted demo kills its whole group (a swift
    launcher and its training child), a finished one is only reaped."""
    import subprocess
    import sys

    import psutil

    said: list[str] = []
    running = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 60"], start_new_session=True)
    child = psutil.Process(running.pid)
    try:
        assert wait_children(child)
        grandchildren = [c.pid for c in child.children()]
        demo.end_by_hand(running, say=said.append)
        assert running.returncode == -9 and said == [f"demo: the demo was interrupted: killed the trainer it "
                                                      f"started (kill -9 -{running.pid})"]
        assert wait_gone(grandchildren), "the group's other process was killed too"
    finally:
        if running.poll() is None:
            os.killpg(running.pid, 9)
            running.wait()
    finished = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    finished.wait()
    said.clear()
    demo.end_by_hand(finished, say=said.append)
    assert finished.returncode == 0 and said == []


def wait_children(p, timeout: float = 30) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not p.children() and time.monotonic() < deadline:  # the shell's fork: no handle to wait on
        time.sleep(0.01)
    return bool(p.children())


def wait_gone(pids: list[int], timeout: float = 30) -> bool:
    """A bounded poll until every pid is gone or a zombie (a SIGKILL lands when the process is next scheduled)."""
    import time

    import psutil

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all(map(gone, pids))
