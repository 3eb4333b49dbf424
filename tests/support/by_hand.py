"""A trainer started by hand, outside the orchestrator (`nohup <command> > train.log 2>&1 &`), and an
`orchestrator watch` of it, for the watch-mode tests (tests/test_watch*.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from orchestrator.config.recipe import load
from orchestrator.config.render.command import render_command
from orchestrator.host.launch.local import resolve

_GROUPS: set[int] = set()  # the process groups start_by_hand made (each trainer leads its own session)


def start_by_hand(recipe_path: Path, stopped: bool = True, **env: str) -> tuple[subprocess.Popen, Path]:
    """Starts the command the recipe renders (what the user's script runs) with nohup, its output to
    <output_dir>/train.log, in its own session; SIGSTOPped at once when `stopped` (the test continues it once
    the watcher is attached: no race with a short run). Returns the process and its log. `swift`/`megatron`
    are looked up next to this interpreter too, as a user's activated venv would find them."""
    r = load(recipe_path)
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = render_command(r, None, r.supervisor.port_range[0])
    log = out / "train.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(["nohup", *resolve(cmd.argv)], stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, env={**os.environ, **cmd.env, **env}, cwd=out,
                                start_new_session=True)
    _GROUPS.add(proc.pid)
    if stopped:
        os.kill(proc.pid, signal.SIGSTOP)
    return proc, log


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends sig to the hand-started trainer's whole process group (a real `swift sft` runs its training in a
    child process): what `kill -SIG -PGID` does."""
    assert proc.pid in _GROUPS, "only a trainer start_by_hand started leads its own group"
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def watcher(*args: str, cwd: Path) -> subprocess.Popen:
    """`orchestrator watch ARGS` in a subprocess, its output in cwd/watch.out and cwd/watch.err."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "watch", *args], cwd=cwd,
                            stdout=open(cwd / "watch.out", "w"), stderr=open(cwd / "watch.err", "w"))


def end(proc: subprocess.Popen) -> None:
    """Kills a process the test started (continued first: a stopped one), with its group when it leads one
    (start_by_hand's), and reaps it."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            if proc.pid in _GROUPS:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                os.kill(proc.pid, sig)
        except OSError:
            pass
    proc.wait(30)
    _GROUPS.discard(proc.pid)
