"""Filling a real filesystem."""
from __future__ import annotations

import os


def fill(path, leave: int = 0) -> None:
    """Write a file until the filesystem has at most `leave` bytes free (ENOSPC ends it)."""
    free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize - leave
    with open(path, "wb") as f:
        try:
            while free > 0:
                free -= f.write(b"\0" * min(free, 1 << 20))
                f.flush()
        except OSError:
            pass
