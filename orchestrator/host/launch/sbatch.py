"""`orchestrator sbatch RECIPE`: the batch script for a multi-node run, and its submission.

One job, `--requeue`d (docs/slurm.md says why not a chain of singleton jobs): the batch shell runs
the supervisor on the first node; Slurm's `--signal=B:USR1@300` reaches the shell 5 minutes before
the time limit, the shell passes it to the supervisor (a graceful stop and final sync, as for a spot
notice) and then requeues the job, whose next supervisor resumes from the journal and checkpoints
on the shared filesystem. The script is built by a pure function; every recipe value is quoted.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from orchestrator.config.recipe import Recipe

PREEMPT_NOTICE_S = 300
MAX_REQUEUES = 20   # a supervisor that keeps dying of a signal is requeued this often, then the job ends


def script(r: Recipe, recipe_path: Path, overrides: tuple[str, ...], python: str = sys.executable) -> str:
    p, out = r.parallel, Path(r.run.output_dir)
    run = [python, "-m", "orchestrator", "run", str(recipe_path.resolve())]
    for o in overrides:
        run += ["--set", o]
    q = shlex.join
    return f"""#!/bin/bash
#SBATCH --job-name={r.run.name}
#SBATCH --nodes={p.nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={p.nproc_per_node}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@{PREEMPT_NOTICE_S}
#SBATCH --output={out}/slurm-%j.out
# Written by `orchestrator sbatch`. The supervisor runs here, on the first node; each attempt is one
# `srun` step over all {p.nnodes} node(s). USR1 ahead of the time limit: graceful stop, then requeue.
set -u
preempted=0
{q(run)} &
supervisor=$!
trap 'preempted=1; kill -USR1 "$supervisor"' USR1
while :; do
  wait "$supervisor"; rc=$?
  kill -0 "$supervisor" 2>/dev/null || break   # wait returns early when a trapped signal arrives
done
if [ "$preempted" = 1 ] && [ "$rc" = 0 ]; then
  echo "orchestrator: stopped ahead of the time limit; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
elif [ "$rc" -gt 128 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {MAX_REQUEUES} ]; then
  # the supervisor died of a signal (137: SIGKILL, an OOM kill): the next one resumes from the journal
  echo "orchestrator: the supervisor died of signal $((rc - 128)); requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""


def submit(path: Path) -> str:
    """sbatch the script; returns the job id."""
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {path} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]
