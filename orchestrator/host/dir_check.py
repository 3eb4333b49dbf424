"""`python -m orchestrator.host.dir_check PATH TOKEN`: does this node see PATH as the supervisor's node does?

srun runs it on every node of the allocation in one step (launch.slurm.node_dir_check): the supervisor's node
wrote PATH/.orchestrator-visible-TOKEN holding TOKEN; this node reads it back and creates and removes a file
of its own there (writable). One JSON line: {"node": "n2", "ok": false, "problem": "..."}. Exit 0 either way.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

MARKER = ".orchestrator-visible-"


def node_view(path: Path, token: str, node: str) -> dict:
    marker = path / f"{MARKER}{token}"
    try:
        seen = marker.read_text()
    except OSError as e:
        return {"node": node, "ok": False, "problem": f"{marker} is not there ({e.strerror}): not the same filesystem"}
    if seen != token:
        return {"node": node, "ok": False, "problem": f"{marker} holds something else: not the same filesystem"}
    probe = path / f"{MARKER}{token}-{node}"
    try:
        probe.write_text(node)
        probe.unlink()
    except OSError as e:
        return {"node": node, "ok": False, "problem": f"cannot write in {path}: {e.strerror}"}
    return {"node": node, "ok": True, "problem": ""}


def main(argv: list[str] | None = None) -> None:
    path, token = (argv or sys.argv[1:])[:2]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(json.dumps(node_view(Path(path), token, node)), flush=True)


if __name__ == "__main__":
    main()
