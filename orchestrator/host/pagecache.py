"""Warm the page cache with the model's weight files while the supervisor waits to relaunch.

A relaunch after a host OOM (or on a node whose memory other work used) reads the weights from disk
again; asking the kernel for them during the wait (posix_fadvise WILLNEED, in chunks, in a thread)
overlaps that read with time spent waiting anyway. Bounded by half the available memory, so the
warm-up never pushes out what else runs; stopped when the trainer starts (its own reads come first).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil

CHUNK = 64 << 20        # one fadvise call: the stop flag is looked at between chunks
MEMORY_SHARE = 0.5      # at most this share of available memory


def weight_files(model_dir: str | Path) -> list[Path]:
    """The model's weight files, largest first (the ones that cost most to read cold)."""
    d = Path(model_dir)
    files = [p for pattern in ("*.safetensors", "*.bin", "*.pt") for p in d.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


class Warmer:
    def __init__(self, files: list[Path], budget_bytes: int | None = None):
        self.files = list(files)
        self.budget = budget_bytes if budget_bytes is not None else int(psutil.virtual_memory().available * MEMORY_SHARE)
        self.requested = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="warm-page-cache", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> int:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        return self.requested

    def _run(self) -> None:
        for path in self.files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, CHUNK):
                    n = min(CHUNK, size - off, self.budget - self.requested)
                    if self.stopped.is_set() or n <= 0:
                        return
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                    self.requested += n
            except OSError:
                continue
            finally:
                os.close(fd)
