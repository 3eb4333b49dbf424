"""The GPU check's processes: child processes whose output lines are logged with their arrival time and can
be waited for, killing a child with everything under it, one-shot commands with a time limit, and what
`nvidia-smi` says (the reference the orchestrator's NVML reader is compared with)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

GRACE_S = 5.0


class Proc:
    """A child process in its own session; its stdout and stderr, merged, go line by line to `log` with the
    seconds since its start, and are kept (time.monotonic() of arrival, line) for wait_line()."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.cmd, self.log = cmd, log
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self.started = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=env, cwd=cwd, start_new_session=True, text=True, errors="replace", bufsize=1)
        self.exited_at: float | None = None
        self._reader = threading.Thread(target=self._read, name=f"read-{self.p.pid}", daemon=True)
        self._reader.start()
        self._waiter = threading.Thread(target=self._wait, name=f"wait-{self.p.pid}", daemon=True)
        self._waiter.start()

    @property
    def pid(self) -> int:
        return self.p.pid

    def _read(self) -> None:
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(self.cmd)}\n")
            assert self.p.stdout is not None
            for line in self.p.stdout:
                now = time.monotonic()
                f.write(f"[{now - self.started:8.3f}] {line}")
                f.flush()
                with self._cond:
                    self.lines.append((now, line.rstrip("\n")))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait(self) -> None:
        self.p.wait()
        with self._cond:
            self.exited_at = time.monotonic()   # the moment this process noticed the exit (waitpid returned)
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float, since: int = 0) -> tuple[int, float, str] | None:
        """Wait for an output line matching `pattern` (from line index `since`): (index, arrival, line), or
        None when the process ended without one or `timeout` passed."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = since
        with self._cond:
            while True:
                while i < len(self.lines):
                    if rx.search(self.lines[i][1]):
                        return i, *self.lines[i]
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or (self.exited_at is not None and not self._reader.is_alive()):
                    return None
                self._cond.wait(min(left, 0.5))

    def wait(self, timeout: float) -> int | None:
        """Wait for the exit; the return code, or None if it still runs after `timeout` s."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> int | None:
        """Send `sig` to the process alone (a supervisor stops its own trainer), then SIGKILL it and everything
        that was or is under it still alive after `grace_s`. Returns its return code."""
        stop_tree(self.p.pid, sig, grace_s)
        self._waiter.join(grace_s)
        self._reader.join(grace_s)
        return self.p.returncode


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _await_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Wait until every one of `procs` has exited, without reaping any (its parent's wait() must see the
    real return code, not ECHILD)."""
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_tree(pid: int, sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> list[int]:
    """Signal `pid`, wait up to `grace_s` for it, then SIGKILL what is left of it and its descendants (gathered
    before and after: a dead parent's children are re-parented). Returns the pids that had to be SIGKILLed."""
    before = _tree(pid)
    if not before:
        return []
    try:
        before[0].send_signal(sig)
    except psutil.NoSuchProcess:
        pass
    _await_gone(before[:1], grace_s)
    left = {p.pid: p for p in before + _tree(pid) if not _gone(p)}
    for p in left.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _await_gone(list(left.values()), grace_s)
    return sorted(left)


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> tuple[int, str]:
    """Run `cmd` to its end or `timeout` s (then its whole session is killed: return code 124), its output
    in `log`. Returns (return code, output)."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                             start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_tree(p.pid, signal.SIGKILL, 1.0)
            p.wait()
            rc = 124
        f.write(f"\n[exit {rc}]\n")
    text = log.read_text(encoding="utf-8", errors="replace")
    return rc, text[text.rfind(f"$ {' '.join(cmd)}\n"):]


# ------------------------------------------------------------------------------------------ nvidia-smi

def smi(args: list[str], timeout: float = 30) -> str:
    """Return nvidia-smi's output for `args` (raises OSError / CalledProcessError when it fails)."""
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def parse_csv(text: str, keys: tuple[str, ...]) -> list[dict[str, str]]:
    """Rows of nvidia-smi's `--format=csv,noheader,nounits` output as dicts of `keys`."""
    return [dict(zip(keys, (c.strip() for c in line.split(",")))) for line in text.splitlines() if line.strip()]


GPU_KEYS = ("index", "uuid", "name", "memory.total", "memory.used", "driver_version")
APP_KEYS = ("pid", "gpu_uuid", "used_memory")


def smi_gpus() -> list[dict[str, str]]:
    """nvidia-smi's view of each GPU (memory in MiB)."""
    return parse_csv(smi([f"--query-gpu={','.join(GPU_KEYS)}", "--format=csv,noheader,nounits"]), GPU_KEYS)


def smi_apps() -> list[dict[str, str]]:
    """nvidia-smi's compute processes (used_memory in MiB)."""
    return parse_csv(smi([f"--query-compute-apps={','.join(APP_KEYS)}", "--format=csv,noheader,nounits"]), APP_KEYS)


def descendants_of_self() -> set[int]:
    """The pids of every process under this one."""
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
