"""A multi-node job submitted with sbatch to the real 3-node test cluster (tests/support/slurm_cluster.py): a node
whose GPU check stays bad is excluded and the job requeues itself onto the remaining nodes, and completes.

The trainer is the fake trainer (tests/support/fake_trainer.py, fast; a real 2-node `swift sft` is what
tests/test_slurm.py runs): rank 0 trains, the other rank exits 0 at once (the fake trainer has no
multi-node mode). What is real: sbatch, the batch script `orchestrator sbatch` writes, the srun steps,
the GPU check step on every node, scontrol requeue / ExcNodeList, and the supervisor. The GPUs are
the stand-in reader (gpu.StandinReader, a documented test seam): node n2 reports a foreign holder.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.config.recipe import load
from orchestrator.host.launch import sbatch
from supervised import FAKE, events, fake_recipe, journal

REPO = Path(__file__).resolve().parents[1]
# rank 0 runs the fake trainer; the other ranks have nothing to do (python -c: argv[0] is "-c")
RANK0_ONLY = ("import os, runpy, sys\nif os.environ.get('NODE_RANK', '0') != '0': sys.exit(0)\n"
              f"sys.argv = [{FAKE!r}] + sys.argv[1:]\nrunpy.run_path({FAKE!r}, run_name='__main__')")


def job_field(cluster, job: str, name: str) -> str:
    m = re.search(rf"\b{name}=(\S*)", cluster.run("scontrol", "show", "job", job, check=False).stdout)
    return m.group(1) if m else ""


def wait_job_done(cluster, job: str, timeout_s: float) -> str:
    """Poll the job until it ends. Slurm holds a requeued job back for the credential lifetime (cred_expire,
    120 s by default; 10 s on the test cluster) before it may start again on nodes that revoked it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_field(cluster, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            time.sleep(3)  # a job being requeued can read as ended for a moment (the batch script's own exit)
            if job_field(cluster, job, "JobState") == state:
                return state
            continue
        time.sleep(0.5)
    return job_field(cluster, job, "JobState")


def completed_attempts(out: Path) -> list:
    """The run's attempts, once its journal says it completed."""
    j = journal(out)
    try:
        assert j.get_all()["state"] == "completed"
        return j.attempts()
    finally:
        j.close()


def submit(cluster, tmp_path: Path, recipe: Path, env: dict) -> str:
    """The script `orchestrator sbatch` writes, less --gpus-per-node (the test cluster has no GPU gres)."""
    text = sbatch.script(load(recipe), recipe, ())
    text = "\n".join(line for line in text.splitlines() if not line.startswith("#SBATCH --gpus-per-node")) + "\n"
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    done = subprocess.run(["sbatch", "--parsable", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_a_node_whose_gpus_stay_busy_is_excluded_and_the_job_requeues_and_completes(cluster, tmp_path):
    standin = tmp_path / "gpus.json"
    standin.write_text(json.dumps({"default": {"gpus": 1}, "n2": {"gpus": 1, "used_mib": 30000, "pids": [4242]}}))
    recipe = fake_recipe(tmp_path, iterations=20, save_steps=5, run={"entrypoint": [sys.executable, "-c", RANK0_ONLY]},
                         parallel={"nnodes": 2, "nproc_per_node": 1, "expert": 1}, gpu={"check": True})
    out = Path(load(recipe).run.output_dir)
    out.mkdir(parents=True)  # as `orchestrator sbatch` does: slurm-%j.out is written there
    env = {**cluster.env, "PYTHONPATH": str(REPO), "ORCHESTRATOR_GPU_STANDIN": str(standin)}
    job = submit(cluster, tmp_path, recipe, env)
    state = wait_job_done(cluster, job, 150)
    log = "\n".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert state == "COMPLETED", f"{state}\n{log[-3000:]}"
    assert job_field(cluster, job, "Restarts") == "1"
    assert job_field(cluster, job, "ExcNodeList") == "n2"
    assert job_field(cluster, job, "NodeList") == "n[1,3]"
    excluded = events(out, "node_excluded")
    assert [e["data"]["node"] for e in excluded] == ["n2", "n2"], excluded   # decided, then requeued
    assert "n2: GPU 0" in " ".join(e["message"] for e in events(out, "gpus_not_clear"))
    runs = completed_attempts(out)
    assert len(runs) == 1 and runs[0].cls is None, "nothing was launched onto n2; one attempt on n1 and n3"


def test_the_supervisor_killed_with_9_is_requeued_resumes_and_stops_nothing_of_another_job(cluster, tmp_path):
    """kill -9 of the supervisor inside the batch job: the batch script sees 137 and requeues the job; the
    next supervisor (same job id, SLURM_RESTART_COUNT 1) resumes from the journal and checkpoints and
    completes, while an unrelated job on the third node keeps running."""
    standin = tmp_path / "gpus.json"
    standin.write_text(json.dumps({"default": {"gpus": 1}}))
    other = cluster.run("sbatch", "--parsable", "-N1", "-w", "n3", "-J", "someone-else", "-o", "/dev/null",
                        "--wrap", "sleep 600").stdout.strip()
    recipe = fake_recipe(tmp_path, iterations=60, save_steps=5, extra_env={"FAKE_STEP_S": "0.1"},
                         run={"entrypoint": [sys.executable, "-c", RANK0_ONLY]},
                         parallel={"nnodes": 2, "nproc_per_node": 1, "expert": 1}, gpu={"check": True})
    out = Path(load(recipe).run.output_dir)
    out.mkdir(parents=True)
    env = {**cluster.env, "PYTHONPATH": str(REPO), "ORCHESTRATOR_GPU_STANDIN": str(standin)}
    try:
        job = submit(cluster, tmp_path, recipe, env)
        pid = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and pid is None:  # the first supervisor, once it saved a checkpoint
            if (out / "checkpoint-10").exists() or list(out.glob("iter_0000010")):
                j = journal(out)
                try:
                    pid = j.get_all().get("supervisor_pid")
                finally:
                    j.close()
            time.sleep(0.1)
        assert pid, "the first supervisor ran and saved"
        os.kill(pid, 9)
        state = wait_job_done(cluster, job, 150)
        log = "\n".join(p.read_text() for p in out.glob("slurm-*.out"))
        assert state == "COMPLETED", f"{state}\n{log[-3000:]}"
        assert "the supervisor died of signal 9; requeueing" in log
        assert job_field(cluster, job, "Restarts") == "1"
        assert job_field(cluster, other, "JobState") == "RUNNING", "the other job was not touched"
        runs = completed_attempts(out)
        assert len(runs) >= 2 and runs[-1].cls is None and runs[-1].resumed_from, runs
    finally:
        cluster.run("scancel", other, check=False)
