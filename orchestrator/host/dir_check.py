"""`python -m orchestrator.host.dir_check PATH TOKEN`: does this node see PATH as the supervisor's node does?

srun runs it on every node of the allocation in one step (launch.slurm.node_dir_check): the supervisor's node
wrote PATH/.orchestrator-visible-TOKEN holding TOKEN; this node reads it back and creates and removes a file
of its own there (writable). One JSON line, as gpu_check prints: {"node": "n2", "clear": false,
"problems": ["..."]}. Exit 0 either way.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

MARKER = ".orchestrator-visible-"


def node_view(path: Path, token: str, node: str) -> dict:
    problem = _problem(path, token, node)
    return {"node": node, "clear": not problem, "problems": [problem] if problem else []}


def _problem(path: Path, token: str, node: str) -> str:
    marker = path / f"{MARKER}{token}"
    try:
        seen = marker.read_text()
    except OSError as e:
        return f"{marker} is not there ({e.strerror}): not the same filesystem"
    if seen != token:
        return f"{marker} holds something else: not the same filesystem"
    probe = path / f"{MARKER}{token}-{node}"
    try:
        probe.write_text(node)
        probe.unlink()
    except OSError as e:
        return f"cannot write in {path}: {e.strerror}"
    return ""


def main(argv: list[str] | None = None) -> None:
    path, token = (argv or sys.argv[1:])[:2]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(json.dumps(node_view(Path(path), token, node)), flush=True)


if __name__ == "__main__":
    main()
