"""Copy a checkpoint dir into a staging dir: rsync where present (a pure-Python fallback otherwise), written
to temp names and renamed, never modifying hard-linked files; flushed to disk, with the sha256 of each file
taken while it was written (tailhash).
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Collection, Iterable
from pathlib import Path

from orchestrator import manifest as mf
from orchestrator.tailhash import TailHasher


def _rsync(src: Path, dst: Path, link_dest: Path | None, excludes: tuple[str, ...], keep_fd: int | None,
           bwlimit_kib: int | None, cancel: threading.Event | None) -> int:
    """rsync src/ into dst/; returns bytes transferred. Raises OSError with rsync's message on failure."""
    # Writes go to a temp name and are renamed (no --inplace), so hard links into published copies made
    # by --link-dest are never modified; --delete(-excluded) clears temp files and leftovers of a killed
    # attempt (a local copy is whole-file, so a partial file would not speed up a retry anyway);
    # --modify-window=-1 compares mtimes to the nanosecond (whole seconds would link same-size files
    # saved within one second of each other).
    argv = [shutil.which("rsync") or "rsync", "-a", "--delete", "--delete-excluded", "--stats", "--no-human-readable",
            "--modify-window=-1", *(f"--exclude=/{p}" for p in excludes)]
    if link_dest is not None:
        argv.append(f"--link-dest={link_dest}")
    if bwlimit_kib:
        argv.append(f"--bwlimit={bwlimit_kib}")
    argv += [f"{src}/", f"{dst}/"]
    # the lock fd is inherited: an rsync orphaned by a killed supervisor keeps the lock until it exits
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=(keep_fd,) if keep_fd is not None else ())
    while True:
        try:
            out, err = proc.communicate(timeout=None if cancel is None else 0.5)
            break
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.is_set():
                proc.terminate()
    if proc.returncode != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        raise OSError(f"rsync exit {proc.returncode}: {lines[-1] if lines else 'no message'}")
    m = re.search(r"Total transferred file size: ([\d,.]+)", out)
    return int(re.sub(r"\D", "", m.group(1))) if m else 0


def same_file(a: os.stat_result, b: Path) -> bool:
    try:
        st = b.stat()
    except OSError:
        return False
    return st.st_size == a.st_size and st.st_mtime_ns == a.st_mtime_ns


def _pycopy(src: Path, dst: Path, link_dest: Path | None, excludes: tuple[str, ...],
            cancel: threading.Event | None) -> int:
    """Pure-Python stand-in for the rsync call (no rsync binary): same skip/link rules, temp name + rename."""
    wanted = [r for r in mf.list_files(src) if not any(fnmatch.fnmatch(r, p) for p in excludes)]
    copied = 0
    for rel in wanted:
        if cancel is not None and cancel.is_set():
            raise OSError("cancelled")
        st, target = (src / rel).stat(), dst / rel
        if same_file(st, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.orch-tmp")
        tmp.unlink(missing_ok=True)
        if not (link_dest is not None and same_file(st, link_dest / rel) and _try_link(link_dest / rel, tmp)):
            shutil.copyfile(src / rel, tmp)
            shutil.copystat(src / rel, tmp)
            copied += st.st_size
        os.replace(tmp, target)
    keep = set(wanted)
    for rel in mf.list_files(dst):  # like --delete: drop what the source no longer has
        if rel not in keep:
            (dst / rel).unlink()
    return copied


def _try_link(a: Path, b: Path) -> bool:
    try:
        os.link(a, b)
        return True
    except OSError:  # a filesystem without hard links: copy instead
        return False


def _fsync_tree(root: Path, done: Collection[str] = ()) -> None:
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            path = os.path.join(dirpath, fn)
            if os.path.relpath(path, root) in done:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        mf.fsync_dir(dirpath)


def copy_tree(src: Path, dst: Path, rels: Iterable[str], link_dest: Path | None, excludes: tuple[str, ...],
              lock_fd: int | None, bwlimit_kib: int | None, cancel: threading.Event | None
              ) -> tuple[int, dict[str, str]]:
    """Copy src/ into dst/ and fsync it; returns bytes copied and the sha256 of those of `rels` hashed
    during the copy (tailhash)."""
    dst.mkdir(parents=True, exist_ok=True)
    with TailHasher(dst, rels) as hasher:
        if shutil.which("rsync"):
            n = _rsync(src, dst, link_dest, excludes, lock_fd, bwlimit_kib, cancel)
        else:
            n = _pycopy(src, dst, link_dest, excludes, cancel)
    digests = hasher.digests()
    _fsync_tree(dst, done=digests)
    return n, digests
