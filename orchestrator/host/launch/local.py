"""Processes: start the trainer in its own session, terminate its whole tree, find leftovers.

The trainer writes straight to a log file (no pipe that can fill and block it); the supervisor
tails that file. Every process we start carries ORCHESTRATOR_RUN=<run id> in its environment, so
leftovers are found even after they were re-parented or left the process group.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from orchestrator.host.notify import child_env
from orchestrator.types import Command, ExitStatus

RUN_MARKER = "ORCHESTRATOR_RUN"


@dataclass
class Launched:
    proc: subprocess.Popen
    log_path: Path
    started_at: float        # wall clock
    started_mono: float      # monotonic
    create_time: float
    exited: threading.Event = field(default_factory=threading.Event)
    status: ExitStatus | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


def resolve(argv: tuple[str, ...]) -> list[str]:
    """argv[0] through PATH, also looking next to this interpreter (the venv's `swift`/`megatron`)."""
    exe = argv[0]
    if os.sep not in exe:
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        exe = shutil.which(exe, path=path) or exe
    return [exe, *argv[1:]]


def locate(argv0: str, env_path: str | None = None, cwd: str | None = None) -> str | None:
    """The executable launch() will start for argv0, or None when there is none (pre-flight's question).
    Popen looks a bare name up on the child's PATH (env_path) and a relative path up under cwd."""
    exe = resolve((argv0,))[0]
    if os.sep not in exe:
        exe = shutil.which(exe, path=env_path) if env_path else None
    elif cwd and not os.path.isabs(exe):
        exe = os.path.join(cwd, exe)
    return exe if exe and os.path.isfile(exe) and os.access(exe, os.X_OK) else None


class LaunchError(Exception):
    """The trainer could not be started at all (executable or working directory missing, not
    executable): nothing runs, so there is no exit status to classify and retrying will not help."""


def launch(cmd: Command, log_path: Path, run_id: str, cwd: str | None = None) -> Launched:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The trainer must not inherit systemd's NOTIFY_SOCKET/WATCHDOG_*: only the supervisor talks to systemd.
    env = {**child_env(), **cmd.env, RUN_MARKER: run_id}
    argv = resolve(cmd.argv)
    with open(log_path, "ab", buffering=0) as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True)
        except OSError as e:  # gone since pre-flight (a venv being reinstalled, an unmounted disk)
            raise LaunchError(f"cannot start the trainer {argv[0]!r} (cwd {cwd or os.getcwd()}): "
                              f"{e.strerror or e}: {e.filename or argv[0]}; check run.entrypoint and the "
                              "environment, then run again") from e
    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        create_time = time.time()
    launched = Launched(proc, log_path, time.time(), time.monotonic(), create_time)

    def reap() -> None:  # a waiter thread turns process exit into an event: noticed at once, no polling
        launched.status = ExitStatus.from_returncode(proc.wait())
        launched.exited.set()

    threading.Thread(target=reap, name=f"reap-{proc.pid}", daemon=True).start()
    return launched


def run_processes(run_id: str, exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """Every live process carrying this run's marker (our trainers and all their descendants)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid in exclude or p.pid == os.getpid():
            continue
        try:
            if p.environ().get(RUN_MARKER) == run_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_all(procs: list[psutil.Process], pgids: set[int], sig: int) -> None:
    for pg in pgids:
        try:
            os.killpg(pg, sig)
        except OSError:
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(procs: list[psutil.Process], timeout: float, step: float = 0.05) -> list[psutil.Process]:
    """Wait until every process exited (a zombie counts: its parent reaps it). Never reaps a child
    itself, unlike psutil.wait_procs, which would steal the exit status from our reaper thread."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(step)
        alive = [p for p in alive if not _gone(p)]
    return alive


def terminate(run_id: str, pgids: set[int], grace_s: float) -> list[int]:
    """SIGTERM the run's process groups and every marked process, wait up to grace_s, then SIGKILL
    what is left (re-parented descendants included: the ms-swift wrappers do not forward signals).
    Returns the pids that had to be SIGKILLed."""
    procs = run_processes(run_id)
    _signal_all(procs, pgids, signal.SIGTERM)
    _signal_all(procs, pgids, signal.SIGCONT)  # a stopped (SIGSTOP) process handles SIGTERM only once continued
    alive = wait_gone(procs, grace_s)
    alive += [p for p in run_processes(run_id) if p not in alive]  # started during the grace period
    if alive:
        _signal_all(alive, pgids, signal.SIGKILL)
        wait_gone(alive, 5)
    return [p.pid for p in alive]


def same_process(pid: int, create_time: float | None) -> bool:
    """Is `pid` still the process we started (not a recycled pid)?"""
    try:
        p = psutil.Process(pid)
        return create_time is None or abs(p.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def dump_stacks(pids: list[int], out: Path, timeout_s: float = 20) -> bool:
    """py-spy stacks of a hung trainer, when py-spy is installed. Best effort, bounded in time."""
    exe = shutil.which("py-spy", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not exe:
        return False
    with open(out, "a") as f:
        for pid in pids:
            f.write(f"===== py-spy dump --pid {pid} ({cmdline(pid)[:200]})\n")
            f.flush()
            try:
                subprocess.run([exe, "dump", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT,
                               timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                f.write("(py-spy timed out)\n")
    return True


class FileTail:
    """New complete lines of a growing file; survives truncation and re-creation."""

    def __init__(self, path: Path, from_end: bool = False):
        self.path, self.pos, self.partial, self.inode = Path(path), 0, b"", None
        if from_end and self.path.exists():
            st = self.path.stat()
            self.pos, self.inode = st.st_size, st.st_ino

    def lines(self, max_bytes: int | None = 8 << 20) -> list[str]:
        """At most max_bytes per call (a pass stays short); None: everything (after the exit)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self.inode or st.st_size < self.pos:
            self.pos, self.partial, self.inode = 0, b"", st.st_ino
        if st.st_size == self.pos:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read(-1 if max_bytes is None else max_bytes)
        self.pos += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        # tqdm writes \r-separated bars: each fragment is its own line for matching.
        return [frag for line in complete for frag in line.decode("utf-8", "replace").split("\r") if frag]


def read_tail(path: Path, max_bytes: int = 34 << 20) -> str:
    """The end of a log, for classification: the classifier reads its last 2 MB and looks back up
    to 32 MB more for a root cause hidden behind a long cascade of NCCL aborts."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
