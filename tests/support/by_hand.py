"""A trainer started by hand, outside the orchestrator (`nohup <command> > train.log 2>&1 &`), and an
`orchestrator watch` of it, for the watch-mode tests (tests/test_watch*.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from orchestrator.config.recipe import load
from orchestrator.config.render.command import render_command
from orchestrator.host.launch.local import resolve
from supervised import events, wait_for

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


# A parent that reaps its trainer at once, as an interactive shell does: it starts the argv read as JSON from stdin
# (not on its own command line, where the watcher would take it for a trainer wrapper) with its output to FILE, in
# a new session, SIGSTOPped after exec; prints its pid, and waits for it: the watcher never sees a zombie.
_REAPER = ("import json, os, signal, subprocess, sys\n"
           "argv = json.loads(sys.stdin.readline())\n"
           "with open(sys.argv[1], 'ab') as f:\n"
           "    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,"
           " start_new_session=True)\n"
           "os.kill(p.pid, signal.SIGSTOP)\n"
           "print(p.pid, flush=True)\n"
           "p.wait()\n")


def start_reaped(recipe_path: Path, **env: str) -> tuple[subprocess.Popen, int]:
    """As start_by_hand (stopped), under a parent that reaps the trainer the moment it ends (a shell running it):
    its exit status is unknown to anyone else. Returns the parent, which ends with the trainer, and the trainer's
    pid; end() of the parent kills the trainer's group too."""
    r = load(recipe_path)
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = render_command(r, None, r.supervisor.port_range[0])
    parent = subprocess.Popen([sys.executable, "-c", _REAPER, str(out / "train.log")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, **cmd.env, **env}, cwd=out)
    assert parent.stdin is not None and parent.stdout is not None
    parent.stdin.write(json.dumps(["nohup", *resolve(cmd.argv)]).encode() + b"\n")
    parent.stdin.close()
    pid = int(parent.stdout.readline())
    _GROUPS.add(pid)
    _REAPED[parent.pid] = pid
    return parent, pid


_REAPED: dict[int, int] = {}  # start_reaped's parent -> its trainer


def kill_group(pgid: int, sig: int) -> None:
    """`kill -SIG -PGID`; a group already gone is no error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def watcher(*args: str, cwd: Path) -> subprocess.Popen:
    """`orchestrator watch ARGS` in a subprocess, its output in cwd/watch.out and cwd/watch.err."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "watch", *args], cwd=cwd,
                            stdout=open(cwd / "watch.out", "w"), stderr=open(cwd / "watch.err", "w"))


def end(proc: subprocess.Popen) -> None:
    """Kills a process the test started (continued first: a stopped one), with its group when it leads one
    (start_by_hand's), and reaps it."""
    group = _REAPED.pop(proc.pid, proc.pid)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            if group in _GROUPS:
                os.killpg(group, sig)
            elif proc.poll() is None:
                os.kill(proc.pid, sig)
        except OSError:
            pass
    proc.wait(30)
    _GROUPS.discard(group)


def kill_unseen(pid: int, watcher_pid: int, timeout: float = 60) -> None:
    """`kill -9 -PGID` of a start_reaped trainer with the watcher held still (SIGSTOP) until the trainer's parent
    has reaped it: the watcher cannot catch the zombie's status in between, as it cannot when a shell reaps."""
    os.kill(watcher_pid, signal.SIGSTOP)
    try:
        kill_group(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while psutil.pid_exists(pid) and time.monotonic() < deadline:  # the reaper's wait(), no handle here
            time.sleep(0.01)
        assert not psutil.pid_exists(pid), f"pid {pid} was not reaped"
    finally:
        os.kill(watcher_pid, signal.SIGCONT)


def attach_watcher(tmp: Path, recipe: Path, pid: int, procs: list, *args: str) -> subprocess.Popen:
    """Starts `orchestrator watch RECIPE ARGS` for the trainer `pid` (stopped at birth), waits until the watcher
    has attached (its `watch` event), then continues the trainer: no race with a short run. Returns the watcher,
    also added to `procs`."""
    w = watcher(str(recipe), *args, cwd=tmp)
    procs.append(w)
    assert wait_for(lambda: events(tmp / "out", "watch") or w.poll() is not None, 120, 0.05)
    assert w.poll() is None, (tmp / "watch.err").read_text()
    os.kill(pid, signal.SIGCONT)
    return w
