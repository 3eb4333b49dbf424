"""Multi-node runs on Slurm (issue 15): srun's failure lines, the step's command, and a real 3-node
Slurm cluster on this machine (tests/support/slurm_cluster.py) running a real 2-node `swift sft` (one rank
per node, gloo) under the supervisor: completes; node 2's trainer SIGKILLed; node 2's trainer SIGSTOPped.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.host.launch import local as launcher
from orchestrator.loop import preflight
from orchestrator.host import dir_check
from orchestrator.host.launch.slurm import (Allocation, NodeFailure, first_failure, node_check_results, node_log,
                                              srun_argv)
from orchestrator.host.node_exec import node_env
from orchestrator.config.recipe import RecipeError, load
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import CrashClass, ExitCode, State
from supervised import attempts, free_port_range

DEMO = Path(__file__).resolve().parents[1] / "orchestrator" / "data" / "demo-cpu.toml"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("log, expected", [
    ("", None),
    ("srun: error: n2: task 1: Killed\n", NodeFailure("n2", "1", "Killed")),
    ("[rank0]: boom\nsrun: error: n2: task 1: Exited with exit code 3\nsrun: error: n1: task 0: Killed\n",
     NodeFailure("n2", "1", "Exited with exit code 3")),
    ("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
     "srun: error: gpu-017: tasks 8-15: Terminated\nsrun: error: gpu-003: task 2: Killed\n",
     NodeFailure("gpu-017", "8-15", "Terminated")),
    ("srun: error: Unable to create step for job 12: Requested nodes are busy\n", None),
    ("  srun: error: node.example.org: task 0: Exited with exit code 1  \n",
     NodeFailure("node.example.org", "0", "Exited with exit code 1")),
])
def test_first_failing_node_from_srun_lines(log, expected):
    assert first_failure(log) == expected


def test_the_step_runs_node_exec_on_every_node_with_a_log_per_node(tmp_path):
    argv = srun_argv(Allocation("42", ("n1", "n2", "n3"), "10.0.0.1"), 2, "orchestrator-x",
                     tmp_path / "attempt-0003.log", ["/venv/bin/swift", "sft", "--model", "a b"])
    assert argv[0] == "srun"
    assert {"--jobid=42", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--nodelist=n1,n2"} <= set(argv)
    assert argv[argv.index("--") - 4:] == [sys.executable, "-m", "orchestrator.host.node_exec",
                                           f"--log={tmp_path}/attempt-0003-node-{{node}}.log", "--",
                                           "/venv/bin/swift", "sft", "--model", "a b"]
    assert node_log(tmp_path / "attempt-0003.log", "n2") == tmp_path / "attempt-0003-node-n2.log"


def test_node_rank_comes_from_slurm_node_id():
    assert node_env({"SLURM_NODEID": "1", "NNODES": "2"})["NODE_RANK"] == "1"
    with pytest.raises(SystemExit, match="SLURM_NODEID"):
        node_env({})


def test_more_than_one_node_outside_an_allocation_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    r = load(DEMO, ["parallel.nnodes=2", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}"])
    with pytest.raises(RecipeError, match="pre-flight nodes: parallel.nnodes = 2 needs a Slurm allocation"):
        Supervisor(r, install_signals=False).run()
    assert not list((tmp_path / "out").rglob("attempt-*.log")), "nothing was launched"


def test_cli_run_exits_2_outside_an_allocation(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(DEMO), "--set", "parallel.nnodes=2",
                           "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "needs a Slurm allocation" in done.stderr


# --- a real cluster ------------------------------------------------------------------------------
swift = pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")


@pytest.fixture
def allocation(cluster, monkeypatch):
    """A 2-node allocation (salloc --no-shell); the supervisor runs here with its SLURM_JOB_ID."""
    out = cluster.run("salloc", "--no-shell", "-N2", "-J", "orch-test").stderr
    job = out.split("Granted job allocation")[1].split()[0]
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the tasks import this checkout's orchestrator
    yield job
    cluster.run("scancel", job, check=False)


def two_node_recipe(tiny, out: Path, *extra: str):
    lo, hi = free_port_range(20)
    return load(DEMO, [f"model.path={json.dumps(tiny['model'])}", f"data.dataset=[{json.dumps(tiny['data'])}]",
                       f"run.output_dir={json.dumps(str(out / 'out'))}", "parallel.nnodes=2",
                       f"run.persistent_dir={json.dumps(str(out / 'persist'))}",
                       "parallel.nproc_per_node=1", "optim.global_batch_size=2", "optim.iterations=40",
                       "checkpoint.save_steps=5", "checkpoint.merge=\"never\"",  # the export phase is tested elsewhere
                       "metrics.listen=\"127.0.0.1:0\"", "metrics.linger_s=0",
                       "supervisor.wait_s=0.5", "supervisor.poll_s=0.1", "supervisor.grace_s=5",
                       f"supervisor.port_range=[{lo}, {hi}]",
                       # each run preprocesses its own dataset cache (--load_from_cache_file): runs compared by loss
                       # must not share one another run may be writing
                       f"env.vars.MODELSCOPE_CACHE={json.dumps(str(out / 'modelscope'))}", *extra])


def losses(out: Path) -> list[tuple[int, float]]:
    return [(int(r["global_step/max_steps"].split("/")[0]), r["loss"])
            for r in map(json.loads, (out / "out" / "logging.jsonl").read_text().splitlines())
            if "loss" in r and "global_step/max_steps" in r]


def node_processes(run_id: str, node: str) -> list[psutil.Process]:
    """This run's processes that Slurm started as `node`'s task (all nodes live on this machine)."""
    found = []
    for p in launcher.run_processes(run_id):
        try:
            if p.environ().get("SLURMD_NODENAME") == node:
                found.append(p)
        except psutil.Error:
            pass
    return found


def at_step_on_node_two(sup: Supervisor, step: int, sig: int, hit: list[int]) -> threading.Thread:
    """Send `sig` to node 2's processes of attempt 1 once its logging.jsonl reaches `step`. The tiny
    model trains fast: the pids are looked up ahead and the log read directly, so the signal lands
    within a step or two."""
    def watch() -> None:
        tail, pids, looked = None, [], 0.0
        while not sup.stop_event.wait(0.02):
            a = sup.attempt
            if sup.state in (State.COMPLETED, State.GAVE_UP) or (a and a.n > 1):
                return
            if a is None:
                continue
            if time.monotonic() - looked > 0.5:
                pids, looked = [p.pid for p in node_processes(sup.ctx.run_id, "n2")], time.monotonic()
            tail = tail or launcher.FileTail(Path(sup.ctx.out) / "logging.jsonl")
            steps = [int(r["global_step/max_steps"].split("/")[0]) for r in map(json.loads, tail.lines())
                     if "global_step/max_steps" in r]
            if pids and steps and max(steps) >= step:
                launcher.kill_pids(pids, sig)
                hit.extend(pids)
                return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


REFERENCE: dict[int, float] = {}


@swift
def test_two_node_swift_run_completes(cluster, allocation, tiny, tmp_path):
    sup = Supervisor(two_node_recipe(tiny, tmp_path), install_signals=False)
    assert sup.run() == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [(a.cls, a.node) for a in runs] == [(None, None)]
    state = Path(runs[0].log_path).parent
    assert {p.name for p in state.glob("attempt-0001*.log")} == \
        {"attempt-0001.log", "attempt-0001-node-n1.log", "attempt-0001-node-n2.log"}
    assert "--nnodes 2 --node_rank 1 --master_addr 127.0.0.1" in (state / "attempt-0001-node-n2.log").read_text()
    assert "--gradient_accumulation_steps 1 " in (state / "attempt-0001-node-n1.log").read_text(), \
        "global batch 2 over 2 nodes x 1 rank"
    assert "global_step" in (state / "attempt-0001-node-n1.log").read_text(), "rank 0's progress on node 1"
    assert (tmp_path / "out" / "checkpoint-40").is_dir()
    REFERENCE.update(losses(tmp_path))
    assert sorted(REFERENCE) == list(range(1, 41))
    assert not cluster.run("squeue", "-h", "-s", "-j", allocation, "-o", "%i %j").stdout.count("orchestrator-"), \
        "no step of the run is left"


def node_two_signalled(sig: signal.Signals, tiny, tmp_path: Path, *overrides: str, relaunched: bool = True):
    """A 2-node run whose node-2 trainer gets `sig` at step 6, supervised to completion in two attempts
    (`relaunched` False: or in one, when the trainer ran on to the end while it was being stopped).
    Returns (supervisor, the pids signalled, the attempts)."""
    sup = Supervisor(two_node_recipe(tiny, tmp_path, *overrides), install_signals=False)
    pids: list[int] = []
    at_step_on_node_two(sup, 6, sig, pids)
    assert sup.run() == ExitCode.OK
    assert pids, f"node 2's trainer was found and sent {sig.name}"
    runs = attempts(tmp_path / "out")
    assert len(runs) == 2 and runs[1].cls is None or not relaunched and len(runs) == 1, runs
    return sup, pids, runs


@swift
def test_node_two_sigkilled_kills_node_one_and_resumes_from_the_last_checkpoint(cluster, allocation, tiny, tmp_path):
    sup, _, runs = node_two_signalled(signal.SIGKILL, tiny, tmp_path)
    assert runs[0].node == "n2", "srun named node 2's task as the first to fail"
    assert runs[0].cls is not None
    srun_log = Path(runs[0].log_path).read_text()
    assert "n2: task 1: Killed" in srun_log
    died_at = runs[0].end_step
    ckpt = int(Path(runs[1].resumed_from).name.split("-")[1])
    assert ckpt % 5 == 0 and ckpt <= died_at < 40, (ckpt, died_at)
    records = losses(tmp_path)
    resumed = records[[s for s, _ in records].index(died_at) + 1:]  # after the killed attempt's records
    assert resumed[0][0] == ckpt + 1
    if REFERENCE:  # the uninterrupted 2-node run of the test above
        assert resumed[0][1] == pytest.approx(REFERENCE[ckpt + 1], rel=1e-6)
    assert max(s for s, _ in records) == 40


@swift
def test_node_two_sigstopped_is_a_hang_the_step_is_cancelled_and_the_run_resumes(cluster, allocation, tiny, tmp_path):
    """Node 2 stops (SIGSTOP: no exit, no srun line); rank 0 blocks in its next collective, so its progress
    stops: a hang after hang_timeout_s. The step is cancelled through Slurm (TERM + CONT: a stopped task
    handles TERM only once continued), gone from `squeue -s` before the relaunch, which completes."""
    # TERM + CONT may let the tiny model run on to step 40 before it stops: then nothing is relaunched (a
    # relaunch from the last step's checkpoint would train a 41st step), and the run is complete
    sup, stopped, runs = node_two_signalled(signal.SIGSTOP, tiny, tmp_path, "supervisor.hang_timeout_s=8",
                                            relaunched=False)
    assert runs[0].cls is CrashClass.NCCL_TIMEOUT_HANG and runs[0].hang_detected_at is not None
    cancel = sup.host.cancels[0]
    assert len(cancel.steps) == 1 and cancel.steps[0].startswith(f"{allocation}.")
    assert cancel.killed == () and cancel.left == (), "TERM + CONT ended the stopped tasks within the grace"
    assert not [p for p in stopped if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert len(runs) == 1 or runs[1].started_at > runs[0].ended_at
    assert max(s for s, _ in losses(tmp_path)) == 40
    assert not cluster.run("squeue", "-h", "-s", "-j", allocation, "-o", "%i %j").stdout.count("orchestrator-")


def shared_check(checks: list[dict]) -> dict:
    return next(c for c in checks if c["name"] == "output_dir_on_every_node")


def test_plan_checks_output_dir_from_every_node(cluster, allocation, tmp_path):
    r = load(DEMO, ["parallel.nnodes=2", f"run.output_dir={json.dumps(str(tmp_path / 'not-yet' / 'out'))}"])
    c = preflight.check_shared_output(r)
    nodes = cluster.run("scontrol", "show", "hostnames", cluster.run("squeue", "-h", "-j", allocation, "-o", "%N")
                        .stdout.strip()).stdout.split()
    assert c.ok, c.detail
    assert c.detail == f"{tmp_path} seen and writable from {', '.join(nodes)}" and len(nodes) == 2
    assert not list(tmp_path.iterdir()), "the markers are gone, nothing created"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_plan_refuses_an_output_dir_the_nodes_do_not_see(cluster, allocation, tmp_path):
    """The planning process alone has a tmpfs over output_dir's parent (its own mount namespace): the nodes
    see the directory underneath, so the marker written there is not there for them."""
    private = tmp_path / "private"
    private.mkdir()
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs none "$1" && shift && exec "$@"',
            "sh", str(private), sys.executable, "-m", "orchestrator", "plan", str(DEMO), "--no-probe", "--json",
            "--set", "parallel.nnodes=2", "--set", f"run.output_dir={json.dumps(str(private / 'out'))}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    c = shared_check(json.loads(done.stdout)["checks"])
    assert not c["ok"] and c["fatal"]
    assert len(re.findall(r"\bn\d: \S+ is not there \(No such file or directory\): not the same filesystem", c["detail"])) == 2, \
        c["detail"]
    assert "must be on a filesystem every node mounts at the same path" in c["detail"]
    assert not list(private.iterdir()), "the marker went with the private tmpfs"


def test_node_dir_check_reads_every_node_s_answer(tmp_path):
    token = "ab12"
    (tmp_path / f"{dir_check.MARKER}{token}").write_text(token)
    assert dir_check.node_view(tmp_path, token, "n1") == {"node": "n1", "clear": True, "problems": []}
    assert "not there" in dir_check.node_view(tmp_path, "other", "n1")["problems"][0]
    (tmp_path / f"{dir_check.MARKER}cd34").write_text("x")
    assert "holds something else" in dir_check.node_view(tmp_path, "cd34", "n1")["problems"][0]
    out = "\n".join([json.dumps(dir_check.node_view(tmp_path, token, "n1")), "noise",
                      json.dumps(dir_check.node_view(tmp_path, "gone", "n2"))])
    bad = node_check_results(out, ("n1", "n2", "n3"))
    assert set(bad) == {"n2", "n3"} and bad["n3"] == ["the check did not answer from this node"]


def test_sbatch_dry_run_prints_a_batch_script_and_submits_nothing(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PYTHONPATH": str(REPO),
           "PATH": "/nonexistent"}  # no sbatch reachable: a dry run must not need one
    done = subprocess.run([sys.executable, "-m", "orchestrator", "sbatch", str(DEMO), "--set", "parallel.nnodes=4",
                           "--set", f"run.output_dir={json.dumps(str(tmp_path / 'o u t'))}", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --requeue",
            "#SBATCH --signal=B:USR1@300", "#SBATCH --gpus-per-node=1"} <= set(lines)
    assert any(" -m orchestrator run " in line and "'run.output_dir=" in line for line in lines), "overrides quoted"
    assert 'scontrol requeue "$SLURM_JOB_ID"' in done.stdout
    assert not (tmp_path / "o u t").exists(), "nothing written"
