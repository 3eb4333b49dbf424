"""A trainer someone started by hand (`nohup megatron sft ... > train.log 2>&1 &`, tmux): found through /proc,
and watched without being its parent.

    find(output_dir)      the running `megatron sft` / `swift sft` / torchrun (or a worker of theirs) whose
                          --output_dir is the run's, outermost process of each tree
    describe(pid)         the same for one pid (`--pid`)
    output_files(pid)     where its stdout and stderr go, when they are regular files (/proc/PID/fd/1, 2)
    WatchedTrainer        the loop's Trainer (host/base.py) for a process that is not our child: an `exited` event
                          set by a poller thread once the process is gone; its exit status is read from
                          /proc/PID/stat while it lingers as a zombie, else unknown (ExitStatus with neither set)

Reading only: nothing here signals, renames or deletes anything.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from orchestrator.types import ExitStatus

POLL_S = 0.1


@dataclass(frozen=True)
class Candidate:
    """A running trainer process: its pid, start time, command line and the output_dir it names."""

    pid: int
    create_time: float
    argv: tuple[str, ...]
    output_dir: Path

    @property
    def command(self) -> str:
        return " ".join(self.argv)


def is_trainer(argv: tuple[str, ...] | list[str]) -> bool:
    """Tells whether a command line is an ms-swift sft (megatron or swift, torchrun or a worker of it): an
    `sft` subcommand or an `sft.py` entry script, and an --output_dir."""
    names = {os.path.basename(a) for a in argv}
    return ("sft" in argv or "sft.py" in names) and output_dir_arg(argv) is not None


def output_dir_arg(argv: tuple[str, ...] | list[str]) -> str | None:
    """The value of --output_dir (`--output_dir X` or `--output_dir=X`; the last one wins, as argparse does)."""
    found = None
    for i, a in enumerate(argv):
        if a in ("--output_dir", "--output-dir") and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(("--output_dir=", "--output-dir=")):
            found = a.split("=", 1)[1]
    return found


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _candidate(p: psutil.Process, output_dir: Path | None) -> Candidate | None:
    try:
        argv = tuple(p.cmdline())
        if not is_trainer(argv) or p.status() == psutil.STATUS_ZOMBIE:
            return None
        arg = output_dir_arg(argv)
        assert arg is not None
        out = Path(arg) if os.path.isabs(arg) else Path(p.cwd()) / arg
        if output_dir is not None and not _same_dir(out, output_dir):
            return None
        return Candidate(p.pid, p.create_time(), argv, out)
    except psutil.Error:
        return None


def find(output_dir: Path) -> list[Candidate]:
    """The trainers writing to output_dir, one per process tree (a torchrun's workers name the same
    output_dir: only the outermost process is the trainer), oldest first."""
    me = os.getpid()
    found = {c.pid: c for p in psutil.process_iter() if p.pid != me
             if (c := _candidate(p, output_dir)) is not None}
    roots = []
    for c in found.values():
        try:
            ancestors = {a.pid for a in psutil.Process(c.pid).parents()}
        except psutil.Error:
            continue
        if not ancestors & found.keys():
            roots.append(c)
    return sorted(roots, key=lambda c: (c.create_time, c.pid))


def describe(pid: int) -> Candidate | None:
    """The trainer that pid is (any output_dir), or None when it is no running ms-swift sft."""
    try:
        return _candidate(psutil.Process(pid), None)
    except psutil.Error:
        return None


def output_files(pid: int) -> list[Path]:
    """The regular files the process's stdout and stderr go to (one when both go to the same file); [] when
    they are a terminal, a pipe, a deleted file or unreadable."""
    out: list[Path] = []
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not stat.S_ISREG(os.stat(f"/proc/{pid}/fd/{fd}").st_mode):
                continue
        except OSError:
            continue
        path = Path(target)
        if not path.is_file():  # deleted since, or an unnamed temporary file: nothing to read by name
            continue
        if path not in out:
            out.append(path)
    return out


def zombie_exit(pid: int, create_time: float) -> ExitStatus | None:
    """The exit status of a process that exited and was not reaped yet (/proc/PID/stat field 52, in waitpid's
    form); None when it is not such a zombie or the field cannot be read."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) >= 1.0 or p.status() != psutil.STATUS_ZOMBIE:
            return None
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return wait_status(int(fields[49]))  # field 52; the split starts at field 3
    except (psutil.Error, OSError, ValueError, IndexError):
        return None


def wait_status(raw: int) -> ExitStatus:
    """A waitpid(2) status as an ExitStatus: a signal death, or an exit code."""
    if os.WIFSIGNALED(raw):
        return ExitStatus(signal=os.WTERMSIG(raw))
    return ExitStatus(code=os.WEXITSTATUS(raw))


UNKNOWN_EXIT = ExitStatus()   # neither code nor signal: the process was not our child and was reaped


@dataclass
class WatchedTrainer:
    """A trainer this process did not start, as the loop's Trainer (host/base.py): `status` is set once the
    process is gone (a zombie's exit status when it lingers, else UNKNOWN_EXIT); `exited` wakes wait_exit."""

    pid_: int
    create_time: float
    log_path: Path
    started_at: float
    started_mono: float
    status: ExitStatus | None = None
    exited: threading.Event = field(default_factory=threading.Event)
    poll_s: float = POLL_S

    @property
    def pid(self) -> int:
        return self.pid_

    @classmethod
    def attach(cls, pid: int, create_time: float, log_path: Path, poll_s: float = POLL_S) -> WatchedTrainer:
        """Starts watching `pid` (started at `create_time`): its start in monotonic time is derived from its age."""
        age = max(0.0, time.time() - create_time)
        t = cls(pid, create_time, log_path, create_time, time.monotonic() - age, poll_s=poll_s)
        threading.Thread(target=t._poll, name=f"watch-{pid}", daemon=True).start()
        return t

    def alive(self) -> bool:
        """The process still runs (a zombie does not; a pid recycled by another process does not)."""
        try:
            p = psutil.Process(self.pid_)
            return abs(p.create_time() - self.create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def tree(self) -> list[int]:
        """The pids of the process and its descendants now."""
        try:
            root = psutil.Process(self.pid_)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            return []

    def _poll(self) -> None:
        while self.alive():
            time.sleep(self.poll_s)
        self.status = zombie_exit(self.pid_, self.create_time) or UNKNOWN_EXIT
        self.exited.set()
