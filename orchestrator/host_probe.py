"""Small probes of this host: is a TCP port free, how much disk is free under a path.

Side effects (a socket bind, a statvfs), kept out of the `plan` command module so the supervisor
can use them without importing a command.
"""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

GIB = 1024**3


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
