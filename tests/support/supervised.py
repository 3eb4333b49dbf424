"""Helpers for tests that run the supervisor against the fake trainer (tests/support/fake_trainer.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from recipes import merge, write_recipe
from orchestrator.types import HealthKind
from orchestrator.host.journal import Journal, journal_path
from orchestrator.store.published import publish_dir
from orchestrator.config.recipe import load, recipe_hash
from orchestrator.store.rundir import state_dir

FAKE = str(Path(__file__).with_name("fake_trainer.py"))
REPO = Path(__file__).resolve().parents[2]
_PORT = [30000 + (os.getpid() % 500) * 20]


def free_port_range(width: int = 10) -> tuple[int, int]:
    """Distinct rendezvous ranges per test (and per xdist worker), so tests never share ports."""
    lo = _PORT[0]
    _PORT[0] += width
    return lo, lo + width - 1


def fake_recipe(tmp: Path, *, iterations: int = 40, save_steps: int = 10, faults: str = "", state: bool = True,
                extra_env: dict | None = None, supervisor: dict | None = None, **sections) -> Path:
    """A megatron recipe whose entrypoint is the fake trainer, with fast waits and its own port range;
    `sections` are deep-merged last (for example run={"entrypoint": [...]})."""
    lo, hi = free_port_range()
    env = {"FAKE_STEP_S": "0.01", "FAKE_STARTUP_S": "0.02", "FAKE_FAULTS": faults, **(extra_env or {})}
    if state:
        env["FAKE_STATE"] = str(tmp / "fake-state.json")
    sup = {"wait_s": 0.05, "force_wait_s": 0.05, "grace_s": 2, "nccl_settle_s": 0.05, "hang_timeout_s": 2,
           "startup_timeout_s": 20, "min_free_gib": 0.01, "poll_s": 0.05, "port_range": [lo, hi],
           **(supervisor or {})}
    fake = {
        "run": {"persistent_dir": "persist", "entrypoint": [sys.executable, FAKE]},
        "optim": {"iterations": iterations, "global_batch_size": 8},
        # a round after every verified save (runs of seconds would never reach the default 30-min cadence)
        "checkpoint": {"save_steps": save_steps, "sync_interval_s": 30, "publish_interval_s": 0},
        "gpu": {"check": False},
        "metrics": {"listen": "127.0.0.1:0", "linger_s": 0},
        "env": {"vars": env},
        "supervisor": sup,
    }
    return write_recipe(tmp, "r.toml", **merge(fake, sections))


def wait_for(cond, timeout: float, step: float = 0.01):
    """Poll `cond` until it is truthy or `timeout` s passed; returns its last value. For events that
    have no handle in the test (a file, a journal row, a process state): a bounded poll, not a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def published_at(recipe_path: Path, *overrides: str) -> Path:
    """Where the run of this recipe publishes: <persistent_dir>/<run.name>-<hash8>."""
    r = load(recipe_path, list(overrides))
    return publish_dir(r.run.persistent_dir, r.run.name, recipe_hash(r))


def health_events(output_dir: Path) -> list[dict]:
    """The run-health events of a run."""
    return [e for e in events(output_dir) if e["kind"] in tuple(HealthKind)]


def supervise(recipe_path: Path, *overrides: str, healthy: bool = True):
    """Run the supervisor in this process; returns (exit code, supervisor). `healthy`: the run is not about run
    health, so it must raise no health event (every normal run is a false-alarm test of the detectors)."""
    from orchestrator.loop.supervisor import Supervisor

    sup = Supervisor(load(recipe_path, list(overrides)), install_signals=False)
    code = sup.run()
    if healthy and sup.ctx is not None:
        found = health_events(sup.ctx.out)
        assert not found, f"a false alarm: {[(e['kind'], e['message']) for e in found]}"
    return code, sup


def cli(*args: str, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=popen.pop("cwd", None), **popen)


def journal(output_dir: Path) -> Journal:
    return Journal(journal_path(state_dir(output_dir)), readonly=True)


def attempts(output_dir: Path):
    if not journal_path(state_dir(output_dir)).exists():
        return []
    j = journal(output_dir)
    try:
        return j.attempts()
    finally:
        j.close()


def events(output_dir: Path, kind: str | None = None) -> list[dict]:
    if not journal_path(state_dir(output_dir)).exists():
        return []
    j = journal(output_dir)
    try:
        return [e for e in j.events(10_000) if kind is None or e["kind"] == kind]
    finally:
        j.close()


def logged_steps(output_dir: Path) -> list[int]:
    steps = []
    for line in (output_dir / "logging.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "iteration" in rec or "global_step/max_steps" in rec:
            steps.append(int((rec.get("iteration") or rec["global_step/max_steps"]).split("/")[0]))
    return steps
