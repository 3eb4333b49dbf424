"""Starting and stopping one attempt of the trainer: one protocol, two backends.

`local`  this machine: the trainer in its own session, its tree terminated by marker and group.
`slurm`  inside a Slurm allocation: the attempt is one job step (`srun` on every node), stopped
         with `scancel` and verified gone through `squeue -s`.

Like torch elastic's split of process starting (multiprocessing/) from rendezvous, the supervisor
never knows which one runs: host.py's LocalHost uses `local`, SlurmHost adds `slurm` on top.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from orchestrator.types import Command


class Launcher(Protocol):
    def launch(self, cmd: Command, log_path: Path, run_id: str, cwd: str | None = None): ...
    def terminate(self, run_id: str, pgids: set[int], grace_s: float) -> list[int]: ...
