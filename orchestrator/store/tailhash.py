"""Hash and flush the files of a staging dir while rsync is still writing them.

Checking a published copy against its manifest means reading every byte again after rsync is done
(sha256), and making it durable means flushing every byte (fsync): done one after the other they cost
about half of the copy again. rsync (without --inplace) writes each file sequentially into a temporary
`.<name>.XXXXXX` beside it and renames it into place when complete, so a thread can follow that file as
it grows, hash the bytes behind rsync's write position and flush them, and be finished moments after the
rename. The result is only a shortcut: a digest counts only while the file still has the inode, size and
mtime it had when hashing ended, and any file the thread missed is hashed afterwards as before.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

CHUNK = 1 << 20
FLUSH_EVERY = 64 << 20   # fdatasync behind the reader, so little is left to write back at the end
POLL_S = 0.005           # while caught up with rsync's writes (~2 MB at rsync's local speed)

_Stamp = tuple[int, int, int, int]   # st_dev, st_ino, st_size, st_mtime_ns


def _stamp(st: os.stat_result) -> _Stamp:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


class TailHasher:
    """`with TailHasher(dst, rels): run rsync`; then `digests()` has sha256 of files still as hashed."""

    def __init__(self, root: Path, rels: Iterable[str]):
        self.root = root
        self._pending = list(rels)
        self._done: dict[str, tuple[_Stamp, str]] = {}
        self._copy_ended = threading.Event()
        self._abandon = threading.Event()  # the copy failed or was cancelled: stop mid-file, do not delay it
        self._thread = threading.Thread(target=self._run, name="tailhash", daemon=True)

    def __enter__(self) -> TailHasher:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is not None:
            self._abandon.set()
        self._copy_ended.set()
        self._thread.join()

    def digests(self) -> dict[str, str]:
        return {rel: digest for rel, (stamp, digest) in self._done.items()
                if (st := _stat(self.root / rel)) is not None and _stamp(st) == stamp}

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        buf = memoryview(bytearray(CHUNK))
        while self._pending and not self._copy_ended.is_set():
            progressed = False
            for rel, path, follow in self._present():
                if self._copy_ended.is_set():
                    return  # what is left is hashed afterwards, in parallel
                try:
                    got = self._hash(os.open(path, os.O_RDONLY), self.root / rel, buf, follow)
                except FileNotFoundError:  # gone between the listing and the open: look again on the next pass
                    continue
                except OSError:  # unreadable here: left to the check after the copy, which reports it
                    self._pending.remove(rel)
                    continue
                if got is not None:
                    self._done[rel] = got
                    self._pending.remove(rel)
                    progressed = True
            if not progressed:
                self._copy_ended.wait(POLL_S)

    def _present(self) -> list[tuple[str, Path, bool]]:
        """(rel, path to open, follow) for pending files that exist whole or as rsync's temp file."""
        by_dir: dict[Path, list[str]] = {}
        for rel in self._pending:
            by_dir.setdefault((self.root / rel).parent, []).append(rel)
        found = []
        for parent, rels in by_dir.items():
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            names = {e.name for e in entries}
            temps: dict[str, list[os.DirEntry]] = {}  # ".<name>.XXXXXX" by <name>
            for e in entries:
                if e.name.startswith(".") and len(e.name) > 8 and e.name[-7] == ".":
                    temps.setdefault(e.name[1:-7], []).append(e)
            for rel in rels:
                name = Path(rel).name
                if name in names:  # complete: renamed into place, hard-linked, or left by a resumed copy
                    found.append((rel, parent / name, False))
                elif name in temps:  # a stale one from a killed copy is dropped once rsync deletes it
                    found.append((rel, Path(temps[name][-1].path), True))
        return found

    def _hash(self, fd: int, final: Path, buf: memoryview, follow: bool) -> tuple[_Stamp, str] | None:
        """Hash fd to its end; when following a temp file, until it is renamed to `final` and fully read."""
        try:
            h, pos, flushed = hashlib.sha256(), 0, 0
            while True:
                if self._abandon.is_set():
                    return None
                n = os.readv(fd, [buf])
                if n:
                    h.update(buf[:n])
                    pos += n
                    if pos - flushed >= FLUSH_EVERY:
                        os.fdatasync(fd)
                        flushed = pos
                    continue
                st = os.fstat(fd)
                if st.st_size > pos:
                    continue
                if follow:
                    now = _stat(final)
                    if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                        if st.st_nlink == 0 or self._copy_ended.is_set():
                            return None  # rsync dropped it, or ended without publishing it
                        self._copy_ended.wait(POLL_S)
                        continue
                    follow = False  # renamed into place: rsync is done with it; read what is left
                    continue
                os.fsync(fd)
                return _stamp(st), h.hexdigest()
        finally:
            os.close(fd)
