"""`python -m orchestrator.host.node_exec [--log PATH] -- ARGV...`: one node's task of a multi-node step.

srun starts this on every node; it sets NODE_RANK from SLURM_NODEID (what ms-swift's torchrun
launch expects), sends the output to PATH with {node} replaced by the Slurm node name, and execs
ARGV: no shell, so no recipe text is ever interpreted by one.
"""
from __future__ import annotations

import os
import sys

from orchestrator.host.launch.local import resolve


def node_env(environ: dict[str, str]) -> dict[str, str]:
    """The task's environment: NODE_RANK from Slurm's node index within the step."""
    if "SLURM_NODEID" not in environ:
        raise SystemExit("node_exec: SLURM_NODEID is not set (run under srun)")
    return {**environ, "NODE_RANK": environ["SLURM_NODEID"]}


def main(argv: list[str]) -> None:
    log = None
    if argv[:1] and argv[0].startswith("--log="):
        log, argv = argv[0].split("=", 1)[1], argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m orchestrator.host.node_exec [--log=PATH] -- COMMAND [ARGS...]")
    env = node_env(dict(os.environ))
    if log:
        path = log.replace("{node}", env.get("SLURMD_NODENAME", env["SLURM_NODEID"]))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    exe = resolve(tuple(argv))
    os.execve(exe[0], exe, env)


if __name__ == "__main__":
    main(sys.argv[1:])
