"""The supervisor's machine when the run spans nodes: a Slurm allocation.

`SlurmHost` is `LocalHost` with the launch part replaced: an attempt is one `srun` job step over
the allocation's nodes; stopping it is `scancel` (TERM, grace, KILL) verified through the
controller; a failure is read from the node whose task srun reports failing first. Everything else
(clock, ports, disk, the run lock) stays on the node that runs the supervisor; output_dir is on the
shared filesystem every node sees.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator.host import gpu
from orchestrator.host.launch import local as launcher
from orchestrator.host.base import Host, LocalHost
from orchestrator.host.launch import slurm
from orchestrator.config.recipe import Recipe
from orchestrator.types import Command


@dataclass
class SlurmStep:
    """The srun process of one attempt, as the loop sees a trainer. `log_path` is rank 0's node log
    (progress is read there); `srun_log` holds srun's own lines (which node failed, and how)."""
    srun: launcher.Launched
    log_path: Path
    nodes: tuple[str, ...]
    step_name: str

    @property
    def srun_log(self) -> Path:
        return self.srun.log_path

    # the Trainer protocol, from the srun process (its reaper thread sets status and exited)
    pid = property(lambda self: self.srun.pid)
    proc = property(lambda self: self.srun.proc)
    create_time = property(lambda self: self.srun.create_time)
    started_at = property(lambda self: self.srun.started_at)
    started_mono = property(lambda self: self.srun.started_mono)
    exited = property(lambda self: self.srun.exited)
    status = property(lambda self: self.srun.status)


@dataclass(frozen=True)
class StepCancel:
    steps: tuple[str, ...]     # the run's steps the controller listed
    killed: tuple[str, ...]    # those still listed after TERM (+CONT) and the grace: SIGKILLed
    left: tuple[str, ...]      # still listed after the KILL and SLURM_TIMEOUT_S: Slurm did not clean up


def step_name(run_id: str) -> str:
    return f"orchestrator-{run_id}"


class SlurmHost(LocalHost):
    def __init__(self, gpu_reader: gpu.GpuReader, nnodes: int, job_id: str) -> None:
        super().__init__(gpu_reader)
        self.nnodes, self.job_id = nnodes, job_id
        self.cancels: list[StepCancel] = []   # what each terminate() did through Slurm (status, tests)

    def launch(self, cmd: Command, log_path: Path, run_id: str, cwd: str) -> SlurmStep:
        try:
            alloc = slurm.allocation(self.job_id)
        except slurm.SlurmError as e:
            raise launcher.LaunchError(f"cannot start the step: {e}") from e
        if len(alloc.nodes) < self.nnodes:
            raise launcher.LaunchError(f"parallel.nnodes = {self.nnodes} but job {self.job_id} has "
                                       f"{len(alloc.nodes)} node(s) ({', '.join(alloc.nodes)}): submit with "
                                       f"--nodes={self.nnodes}")
        nodes = alloc.nodes[:self.nnodes]
        env = {**cmd.env, "NNODES": str(self.nnodes), "MASTER_ADDR": alloc.master_addr}
        name = step_name(run_id)
        try:  # Slurm's cleanup of the last step, verified: a step still ending holds its nodes
            left = slurm.wait_steps_gone(self.job_id, name, slurm.SLURM_TIMEOUT_S)
        except slurm.SlurmError as e:
            raise launcher.LaunchError(f"cannot start the step: {e}") from e
        if left:
            raise launcher.LaunchError(f"step(s) {', '.join(left)} of job {self.job_id} are still listed by "
                                       f"`squeue -s` after {slurm.SLURM_TIMEOUT_S} s: Slurm has not cleaned up the "
                                       "last attempt; check the nodes (scontrol show node) and slurmd's log")
        argv = slurm.srun_argv(alloc, self.nnodes, name, log_path, launcher.resolve(cmd.argv))
        srun = launcher.launch(Command(tuple(argv), env), log_path, run_id, cwd=cwd)
        rank0 = slurm.node_log(log_path, nodes[0])
        rank0.touch()
        return SlurmStep(srun, rank0, nodes, name)

    def terminate(self, run_id: str, pgids: set[int], grace_s: float) -> list[int]:
        """The step on every node through Slurm first (TERM, grace, KILL, gone), then what is left here."""
        try:
            steps = slurm.live_steps(self.job_id, step_name(run_id))
            killed, left = slurm.cancel_steps(self.job_id, step_name(run_id), grace_s)
            self.cancels.append(StepCancel(tuple(steps), tuple(killed), tuple(left)))
        except slurm.SlurmError:
            pass  # the controller is unreachable: still stop what runs here
        return super().terminate(run_id, pgids, grace_s)

    def nodes(self) -> tuple[str, ...]:
        try:
            return slurm.allocation(self.job_id).nodes[:self.nnodes]
        except slurm.SlurmError:
            return ()

    def node_gpu_problems(self, ids: list[int | str], threshold_mib: int) -> dict[str, list[str]]:
        """Every node's GPUs in one step (`srun ... python -m orchestrator.host.gpu_check`), before each launch."""
        try:
            alloc = slurm.allocation(self.job_id)
        except slurm.SlurmError as e:
            return {slurm.ALL_NODES: [f"cannot check the nodes' GPUs: {e}"]}
        return slurm.node_gpu_check(alloc, self.nnodes, ids, threshold_mib)

    def exclude_node(self, node: str) -> str:
        return slurm.requeue_excluding(self.job_id, node)

    def failure_log(self, trainer: SlurmStep) -> tuple[str, str | None]:
        """The failing node's log first (the root cause), srun's lines, then the other nodes' logs
        (cascades: the classifier ranks root causes above them). Returns (text, failing node)."""
        srun_text = self.read_tail(trainer.srun_log)
        first = slurm.first_failure(srun_text)
        order = list(trainer.nodes)
        if first and first.node in order:
            order.remove(first.node)
            order.insert(0, first.node)
        parts = [self.read_tail(slurm.node_log(trainer.srun_log, n)) for n in order[:1]]
        parts.append(srun_text)
        parts += [self.read_tail(slurm.node_log(trainer.srun_log, n)) for n in order[1:]]
        return "\n".join(parts), first.node if first else None


def host_for(recipe: Recipe, gpu_reader: gpu.GpuReader) -> Host:
    """LocalHost for one node (today's behaviour); SlurmHost for parallel.nnodes > 1 inside an allocation
    (outside one, pre-flight's `nodes` check refuses the run before anything is launched)."""
    job = os.environ.get("SLURM_JOB_ID")
    if recipe.parallel.nnodes > 1 and job:
        return SlurmHost(gpu_reader, recipe.parallel.nnodes, job)
    return LocalHost(gpu_reader)
