"""Small probes of this host: is a TCP port free, how much disk is free under a path.

Side effects (a socket bind, a statvfs), kept out of the `plan` command module so the supervisor
can use them without importing a command.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from orchestrator.types import GIB

PROBE_BYTES = 64 << 20


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def first_free_port(lo: int, hi: int, avoid: set[int] = frozenset(), is_free=port_free) -> int | None:
    """`is_free`: the probe to ask (the supervisor passes its host's)."""
    return next((p for p in range(lo, hi + 1) if p not in avoid and is_free(p)), None)


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG, EACCES: treat as absent, the check then says what is missing
        return False


def existing_parent(path: Path) -> Path:
    while not exists(path) and path != path.parent:
        path = path.parent
    return path


def free_gib(path: str) -> float:
    """Free space on the filesystem that holds `path`, or would hold it once created."""
    return shutil.disk_usage(existing_parent(Path(path))).free / GIB


def mount_point(path: str) -> Path:
    p = existing_parent(Path(path)).resolve()
    try:
        while p != p.parent and os.stat(p.parent).st_dev == os.stat(p).st_dev:
            p = p.parent
    except OSError:
        pass
    return p


def free_bytes(path: str) -> int:
    return shutil.disk_usage(existing_parent(Path(path))).free


def held_bytes(directory: str) -> int:
    """Bytes on disk in `directory`'s checkpoint-* entries (partial copies included): space retention
    reuses, so a restarted run is not refused for the checkpoints it already holds. A file hard-linked into
    several copies (published copies share unchanged files) counts once."""
    seen: dict[tuple[int, int], int] = {}
    try:
        entries = [e for e in os.scandir(directory) if "checkpoint-" in e.name]
    except OSError:
        return 0
    for e in entries:
        for root, _dirs, files in os.walk(e.path) if e.is_dir(follow_symlinks=False) else [("", [], [e.path])]:
            for f in files:
                try:
                    st = os.lstat(os.path.join(root, f))
                except OSError:
                    continue
                seen[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def probe_write(directory: str, nbytes: int = PROBE_BYTES) -> tuple[float | None, str]:
    """Write speed of `directory`'s filesystem in bytes/s: `nbytes` of random data written and fsync'd to a
    hidden file in the nearest existing parent, removed afterwards. -> (bytes/s or None, detail)."""
    d = existing_parent(Path(directory))
    try:
        nbytes = min(nbytes, shutil.disk_usage(d).free // 4)  # never the probe that fills a disk
    except OSError as e:
        return None, f"{d}: cannot stat ({e.strerror or e})"
    if nbytes < 1 << 20:
        return None, f"{d}: less than 4 MiB free, not probed"
    block = os.urandom(1 << 20)  # incompressible: a compressing filesystem must not flatter the number
    path = d / f".orchestrator-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.monotonic()
            for _ in range(nbytes >> 20):
                os.write(fd, block)
            os.fsync(fd)
            elapsed = time.monotonic() - t0
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"{d}: probe write failed ({e.strerror or e})"
    finally:
        path.unlink(missing_ok=True)
    written = (nbytes >> 20) << 20
    return written / max(elapsed, 1e-6), f"{d}: {written >> 20} MiB fsync'd in {elapsed:.2f} s"
