"""The node's failure history: each run's crashes and running hours on this machine, so a new run's
`save_steps = "auto"` starts from what earlier runs here saw instead of the prior alone.

One small JSON file, `node.json`, in the node state directory:
  $ORCHESTRATOR_NODE_STATE_DIR, else /var/lib/orchestrator as root, else $XDG_STATE_HOME/orchestrator
  (default ~/.local/state/orchestrator).
  {"runs": {"<run id>": {"failures": 3, "hours": 41.5, "updated_at": 1.7e9}}}
Each supervisor rewrites its own run's entry at every launch (the totals from its journal: idempotent),
under an flock, by rename: a kill mid-write leaves the old file. An unreadable file counts as empty
(the history is evidence, never a reason to stop a run), and so does an entry whose numbers are not numbers.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

FILE = "node.json"


def node_state_dir() -> Path:
    env = os.environ.get("ORCHESTRATOR_NODE_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/orchestrator")
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "orchestrator"


class NodeHistory:
    def __init__(self, directory: Path | None = None):
        self.path = (directory or node_state_dir()) / FILE

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) and isinstance(data.get("runs"), dict) else {"runs": {}}
        except (OSError, ValueError):
            return {"runs": {}}

    def others(self, run_id: str) -> tuple[float, float]:
        """(failures, hours) of every other run recorded on this node."""
        failures = hours = 0.0
        for rid, r in self._read()["runs"].items():
            if rid != run_id and isinstance(r, dict):
                f, h = _count(r.get("failures")), _count(r.get("hours"))
                if f is not None and h is not None:  # an entry with a non-number says nothing: left out whole
                    failures, hours = failures + f, hours + h
        return failures, hours

    def record(self, run_id: str, failures: int, hours: float, now: float) -> str | None:
        """This run's totals so far. Returns why it could not be written (a read-only disk), else None."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = self._read()
                data["runs"][run_id] = {"failures": failures, "hours": round(hours, 4), "updated_at": now}
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{FILE}.")
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        except OSError as e:
            return f"{self.path}: {e.strerror or e}"
        return None


def _count(value: object) -> float | None:
    """A recorded count or duration as a float (missing: 0); None when it is not a finite number >= 0."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < float("inf") else None
