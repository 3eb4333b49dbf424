"""NCCL's shared-memory segments in /dev/shm: which belong to a run, who still maps them.

NCCL (src/misc/shmutils.cc, ncclShmOpen) creates its host buffers as `/dev/shm/nccl-XXXXXX` (mkstemp's
six random characters) and unlinks each once every local peer has mapped it (a refcount in the
segment). A rank killed with SIGKILL during setup never unlinks: the file stays and holds tmpfs memory
until removed. The kernel frees a mapping when the last process mapping it exits, so "gone" means:
no live process maps it or holds it open, and no file left behind.

A segment is the run's when a live process of the run maps or holds it, or when it was created
after the run's first launch on this host and no process outside the run holds it (another job's
segment is never touched).
"""
from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = "/dev/shm"
PREFIX = "nccl-"


def holders(paths: set[str], proc: str = "/proc") -> dict[str, list[int]]:
    """path -> the pids mapping it (/proc/PID/maps) or holding it open (/proc/PID/fd), for `paths`."""
    found: dict[str, set[int]] = {p: set() for p in paths}
    if not paths:
        return {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)")
                    if path in found:
                        found[path].add(pid)
            for fd in os.scandir(f"{proc}/{pid}/fd"):
                target = os.readlink(fd.path)
                if target in found:
                    found[target].add(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {p: sorted(pids) for p, pids in found.items()}


def run_segments(shm_dir: str, run_pids: set[int], since: float | None) -> dict[str, list[int]]:
    """The run's `nccl-*` segments under shm_dir: name -> the live pids that map or hold it ([] = orphaned)."""
    try:
        candidates = {e.path: e for e in os.scandir(shm_dir) if e.name.startswith(PREFIX) and e.is_file()}
    except OSError:
        return {}
    if not candidates:
        return {}
    held = holders(set(candidates))
    mine = {}
    for path, pids in held.items():
        ours = bool(set(pids) & run_pids)
        try:
            created_since = since is not None and candidates[path].stat().st_ctime >= since - 1.0 \
                and candidates[path].stat().st_uid == os.getuid()
        except OSError:
            continue
        if ours or (created_since and not pids):
            mine[Path(path).name] = pids
    return mine


def remove(shm_dir: str, names: list[str]) -> None:
    for name in names:
        if name.startswith(PREFIX) and "/" not in name:
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                pass
