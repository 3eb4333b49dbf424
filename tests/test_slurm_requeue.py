"""A multi-node job submitted with sbatch to the real 3-node test cluster (tests/slurm_cluster.py): a node
whose GPU check stays bad is excluded and the job requeues itself onto the remaining nodes, and completes.

The trainer is the fake trainer (tests/fake_trainer.py, fast; a real 2-node `swift sft` is what
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

import pytest

import slurm_cluster
from orchestrator.config.recipe import load
from orchestrator.host.launch import sbatch
from supervised import FAKE, events, fake_recipe, journal

REPO = Path(__file__).resolve().parents[1]
# rank 0 runs the fake trainer; the other ranks have nothing to do (python -c: argv[0] is "-c")
RANK0_ONLY = ("import os, runpy, sys\nif os.environ.get('NODE_RANK', '0') != '0': sys.exit(0)\n"
              f"sys.argv = [{FAKE!r}] + sys.argv[1:]\nrunpy.run_path({FAKE!r}, run_name='__main__')")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    try:
        c = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"Slurm test cluster did not start: {e}")
    yield c
    c.stop()


def job_field(cluster, job: str, name: str) -> str:
    m = re.search(rf"\b{name}=(\S*)", cluster.run("scontrol", "show", "job", job, check=False).stdout)
    return m.group(1) if m else ""


def wait_job_done(cluster, job: str, timeout_s: float) -> str:
    """Poll the job until it ends; a requeued job is made eligible at once (Slurm holds a requeued job back
    ~2 minutes before it may start again: a site delay, not what is tested)."""
    deadline, nudged = time.monotonic() + timeout_s, set()
    while time.monotonic() < deadline:
        state, restarts = job_field(cluster, job, "JobState"), job_field(cluster, job, "Restarts")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if state == "PENDING" and restarts not in nudged and restarts != "0":
            cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            nudged.add(restarts)
        time.sleep(0.5)
    return job_field(cluster, job, "JobState")


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
    j = journal(out)
    try:
        assert j.get_all()["state"] == "completed"
        runs = j.attempts()
    finally:
        j.close()
    assert len(runs) == 1 and runs[0].cls is None, "nothing was launched onto n2; one attempt on n1 and n3"
