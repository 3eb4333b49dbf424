"""One attempt as one Slurm job step: `srun` on every node of the allocation, `scancel` to stop it.

Slurm does placement, launch and cleanup across nodes; this module only builds the srun line, reads
srun's own report of which node failed first, and cancels a step and waits until Slurm says it is
gone (a step still ending holds its nodes: the next srun would queue behind it). The parsing is pure
(table-tested); the rest runs the Slurm client commands.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.host import dir_check

SLURM_TIMEOUT_S = 30   # a Slurm client command that takes longer than this: the controller is in trouble
# srun's report of a task that ended badly, e.g. "srun: error: n2: task 1: Killed",
# "srun: error: n2: tasks 2-3: Exited with exit code 3", "srun: error: n2: task 1: Terminated".
TASK_FAILURE = re.compile(r"^srun: error: (?P<node>[A-Za-z0-9_.\-\[\]]+): tasks? (?P<tasks>[0-9,\-]+): (?P<how>.+?)\s*$")


class SlurmError(Exception):
    """A Slurm client command failed: no allocation, a controller that does not answer."""


@dataclass(frozen=True)
class NodeFailure:
    node: str
    tasks: str
    how: str          # "Killed", "Exited with exit code 3", ...


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]    # in allocation order: the first one is MASTER_ADDR's node
    master_addr: str


def task_failures(srun_log: str) -> list[NodeFailure]:
    """srun's task failure lines, in the order srun wrote them (the first is the first to fail)."""
    found = []
    for line in srun_log.splitlines():
        m = TASK_FAILURE.match(line.strip())
        if m:
            found.append(NodeFailure(m["node"], m["tasks"], m["how"]))
    return found


def first_failure(srun_log: str) -> NodeFailure | None:
    """The node whose task failed first. A task that srun itself killed after another one failed
    (--kill-on-bad-exit) reports as Killed/Terminated after it, so the first line is the root."""
    failures = task_failures(srun_log)
    return failures[0] if failures else None


def node_log(log_path: Path, node: str) -> Path:
    """attempt-0003.log (srun's own output) -> attempt-0003-node-n2.log (that node's trainer)."""
    return log_path.with_name(f"{log_path.stem}-node-{node}{log_path.suffix}")


def srun_argv(alloc: Allocation, nnodes: int, step_name: str, log_path: Path, argv: list[str]) -> list[str]:
    """One task per node running node_exec (NODE_RANK from SLURM_NODEID), which sends the node's output
    to its own file, named by the Slurm node name (srun's --output=%N is the host name, which several
    slurmd on one host share); srun's own messages go to srun's stderr, the attempt log."""
    return ["srun", f"--jobid={alloc.job_id}", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", f"--job-name={step_name}", "--export=ALL", "--unbuffered",
            f"--nodelist={','.join(alloc.nodes[:nnodes])}",
            "--input=none", sys.executable, "-m", "orchestrator.host.node_exec",
            f"--log={node_log(log_path, '{node}')}", "--", *argv]


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _slurm(*argv: str, survive_requeue: bool = False) -> str:
    """`survive_requeue`: the command runs inside the job being requeued, whose processes Slurm sends SIGTERM
    at once: it ignores it (SIGKILL comes only after KillWait)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, check=False,
                              preexec_fn=_ignore_term if survive_requeue else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[:500]}")
    return done.stdout


def allocation(job_id: str | None = None) -> Allocation:
    """This job's nodes (scontrol show hostnames), and the address of the first (its NodeAddr: what
    Slurm itself uses to reach it; on most clusters the same as its name)."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise SlurmError("SLURM_JOB_ID is not set: not inside a Slurm allocation")
    nodelist = _slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()
    if not nodelist:
        raise SlurmError(f"job {job_id} has no nodes (not running?)")
    nodes = tuple(_slurm("scontrol", "show", "hostnames", nodelist).split())
    m = re.search(r"\bNodeAddr=(\S+)", _slurm("scontrol", "show", "node", nodes[0]))
    return Allocation(job_id, nodes, m.group(1) if m else nodes[0])


def live_steps(job_id: str, step_name: str) -> list[str]:
    """Step ids ("12.3") of this job still known to the controller under this name."""
    out = _slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j")
    return [sid for sid, name in (line.split(None, 1) for line in out.splitlines() if " " in line.strip())
            if name.strip() == step_name]


def wait_steps_gone(job_id: str, step_name: str, timeout_s: float, step_s: float = 0.2) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = live_steps(job_id, step_name)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(step_s)


def cancel_steps(job_id: str, step_name: str, grace_s: float) -> tuple[list[str], list[str]]:
    """SIGTERM the step's tasks on every node, wait up to grace_s, then SIGKILL; wait until the
    controller no longer lists the step. Returns (steps that needed SIGKILL, steps still listed)."""
    steps = live_steps(job_id, step_name)
    for sid in steps:
        for sig in ("TERM", "CONT"):  # a stopped (SIGSTOP) task handles SIGTERM only once continued
            try:
                _slurm("scancel", f"--signal={sig}", sid)
            except SlurmError:  # the step ended meanwhile (TERM was enough): the wait below says so
                pass
    killed = wait_steps_gone(job_id, step_name, grace_s)
    for sid in killed:
        _slurm("scancel", "--signal=KILL", sid)
    left = wait_steps_gone(job_id, step_name, SLURM_TIMEOUT_S) if killed else []
    return killed, left


ALL_NODES = "*"   # key of a problem that is no node's own (the check step itself failed)


def node_check_results(stdout: str, nodes: tuple[str, ...]) -> dict[str, list[str]]:
    """Problems per node from a node check's JSON lines ({"node", "clear", "problems"}; a node with no line did
    not answer); {}: all clear."""
    seen: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "node" in d:
            seen[d["node"]] = [] if d.get("clear") else list(d.get("problems") or ["not clear"])
    bad = {n: p for n, p in seen.items() if p}
    bad.update({n: ["the check did not answer from this node"] for n in nodes if n not in seen})
    return bad


def node_check(alloc: Allocation, nnodes: int, module: str, args: list[str], timeout_s: float) -> dict[str, list[str]]:
    """`python -m <module> <args>` on each of the first `nnodes` nodes, in one step (one task per node, in
    parallel); problems per node, {}: all clear. --overlap: a check must never queue behind a step that is
    still ending."""
    nodes = alloc.nodes[:nnodes]
    argv = ["srun", f"--jobid={alloc.job_id}", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--overlap", f"--job-name=orchestrator-{module.rsplit('.', 1)[-1].replace('_', '-')}",
            f"--nodelist={','.join(nodes)}", "--input=none", sys.executable, "-m", module, *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {ALL_NODES: [f"the check step did not finish: {e}"]}
    bad = node_check_results(done.stdout, nodes)
    if done.returncode != 0 and not bad:
        bad[ALL_NODES] = [f"the check step exited {done.returncode}: {done.stderr.strip()[-300:]}"]
    return bad


def node_gpu_check(alloc: Allocation, nnodes: int, ids: list, threshold_mib: int,
                   timeout_s: float = 120) -> dict[str, list[str]]:
    """Every node's GPU verdict (host/gpu_check.py)."""
    return node_check(alloc, nnodes, "orchestrator.host.gpu_check",
                      [f"--ids={','.join(map(str, ids))}", f"--threshold-mib={threshold_mib}"], timeout_s)


def node_dir_check(alloc: Allocation, nnodes: int, path: Path, timeout_s: float = 60) -> dict[str, list[str]]:
    """Whether every node sees `path` as this node does: a marker with a fresh token written here, read back
    on each node, which also creates and removes a file there (host/dir_check.py)."""
    token = os.urandom(8).hex()
    marker = path / f"{dir_check.MARKER}{token}"
    try:
        marker.write_text(token)
    except OSError as e:
        return {ALL_NODES: [f"cannot write the marker {marker}: {e.strerror}"]}
    try:
        return node_check(alloc, nnodes, "orchestrator.host.dir_check", [str(path), token], timeout_s)
    finally:
        marker.unlink(missing_ok=True)


def requeue_excluding(job_id: str, node: str) -> str:
    """Requeue this job without `node`. Slurm changes ExcNodeList of a pending job only ("Job is no longer
    pending execution"), so: requeue first (the job goes back to pending; Slurm holds a requeued job back
    before it is eligible again), then add the node to the job's excluded nodes. Returns the new list."""
    m = re.search(r"\bExcNodeList=(\S+)", _slurm("scontrol", "show", "job", job_id))
    before = [] if not m or m.group(1) == "(null)" else _slurm("scontrol", "show", "hostnames", m.group(1)).split()
    excluded = ",".join(sorted({*before, node}))
    _slurm("scontrol", "requeue", job_id)
    for tries_left in reversed(range(21)):  # the requeue returns before the job is pending again
        try:
            _slurm("scontrol", "update", f"JobId={job_id}", f"ExcNodeList={excluded}", survive_requeue=True)
            return excluded
        except SlurmError as e:
            if "pending" not in str(e) or not tries_left:
                raise
            time.sleep(0.25)
