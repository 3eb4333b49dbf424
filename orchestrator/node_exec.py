"""`python -m orchestrator.node_exec -- ARGV...`: one node's task of a multi-node step.

srun starts this on every node; it sets NODE_RANK from SLURM_NODEID (what ms-swift's torchrun
launch expects) and execs ARGV: no shell, so no recipe text is ever interpreted by one.
"""
from __future__ import annotations

import os
import sys

from orchestrator.launcher import resolve


def node_env(environ: dict[str, str]) -> dict[str, str]:
    """The task's environment: NODE_RANK from Slurm's node index within the step."""
    if "SLURM_NODEID" not in environ:
        raise SystemExit("node_exec: SLURM_NODEID is not set (run under srun)")
    return {**environ, "NODE_RANK": environ["SLURM_NODEID"]}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m orchestrator.node_exec -- COMMAND [ARGS...]")
    exe = resolve(tuple(argv))
    os.execve(exe[0], exe, node_env(dict(os.environ)))


if __name__ == "__main__":
    main(sys.argv[1:])
