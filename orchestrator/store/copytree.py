"""Copy a checkpoint dir into a staging dir: rsync where present (a pure-Python fallback otherwise), written
to temp names and renamed, never modifying hard-linked files; flushed to disk, with the sha256 of each file
taken while it was written (tailhash).

Large files (the shards that are nearly all of a checkpoint's bytes) are copied beside rsync by a few
threads, each reading and hashing one file in a pipeline with its writer (O_DIRECT where the filesystem
takes it: _pipe_copy): one rsync moves one file at a time through two
processes and a pipe, and the hash of its output is taken by one more thread behind it, so a multi-GiB
checkpoint was copied, hashed and flushed one stream at a time. The threads keep rsync's rules (temp name
+ rename, files already in place or linkable from the previous copy are not rewritten, mtime and mode
kept) and rsync protects their files from its --delete.
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import mmap
import os
import queue
import re
import shutil
import subprocess
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.store import manifest as mf
from orchestrator.store.tailhash import TailHasher


PARALLEL_MIN_BYTES = 64 << 20   # files this large are copied by the threads, not rsync
COPY_WORKERS = 4                # threads for them: hashing is CPU-bound, so a few beyond the cores keep the disk busy
BUFFER = 16 << 20               # one read, hash and write of a large file; DEPTH of them in flight per file
                                # (4 files x 4 x 16 MiB: 256 MiB of buffers while a checkpoint is copied)
DEPTH = 4
WRITERS = 2                     # per file: O_DIRECT writes are synchronous, so two keep the device busy
ALIGN = 4096                    # O_DIRECT: buffer address, file offset and length in whole blocks
PARTIAL_SUFFIX = ".orch-partial"  # `.<name>.orch-partial`: not rsync's `.<name>.XXXXXX`, so tailhash ignores it


def _rsync(src: Path, dst: Path, link_dest: Path | None, excludes: tuple[str, ...], keep_fd: int | None,
           bwlimit_kib: int | None, cancel: threading.Event | _Either | None, protect: Collection[str] = ()) -> int:
    """rsync src/ into dst/; returns bytes transferred. Raises OSError with rsync's message on failure."""
    # Writes go to a temp name and are renamed (no --inplace), so hard links into published copies made
    # by --link-dest are never modified; --delete(-excluded) clears temp files and leftovers of a killed
    # attempt (a local copy is whole-file, so a partial file would not speed up a retry anyway);
    # --modify-window=-1 compares mtimes to the nanosecond (whole seconds would link same-size files
    # saved within one second of each other).
    argv = [shutil.which("rsync") or "rsync", "-a", "--delete", "--delete-excluded", "--stats", "--no-human-readable",
            "--modify-window=-1", *(f"--exclude=/{p}" for p in excludes)]
    for rel in protect:  # copied by the threads: rsync neither sends nor deletes them (or their temp files)
        name = _rsync_literal(rel)
        temp = _rsync_literal(_temp_of(Path(rel)).as_posix())
        argv += [f"--filter=P /{name}", f"--filter=P /{temp}", f"--exclude=/{name}", f"--exclude=/{temp}"]
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


def _rsync_literal(rel: str) -> str:
    if not re.search(r"[*?\[]", rel):
        return rel  # no wildcard: rsync matches it literally, backslashes included
    return re.sub(r"([*?\[\\])", r"\\\1", rel)  # rsync patterns with wildcards honour backslash escapes


def _temp_of(target: Path) -> Path:
    return target.with_name(f".{target.name}{PARTIAL_SUFFIX}")


def same_file(a: os.stat_result, b: Path) -> bool:
    try:
        st = b.stat()
    except OSError:
        return False
    return st.st_size == a.st_size and st.st_mtime_ns == a.st_mtime_ns


def _pycopy(src: Path, dst: Path, link_dest: Path | None, excludes: tuple[str, ...],
            cancel: threading.Event | _Either | None, protect: Collection[str] = ()) -> int:
    """Pure-Python stand-in for the rsync call (no rsync binary): same skip/link rules, temp name + rename."""
    wanted = [r for r in mf.list_files(src) if not _excluded(r, excludes) and r not in protect]
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
    keep = set(wanted) | set(protect) | {_temp_of(Path(r)).as_posix() for r in protect}
    for rel in mf.list_files(dst):  # like --delete: drop what the source no longer has
        if rel not in keep:
            (dst / rel).unlink()
    return copied


def _excluded(rel: str, excludes: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in excludes)


def _large_files(src: Path, rels: Iterable[str], excludes: tuple[str, ...]) -> list[tuple[str, os.stat_result]]:
    """The files the threads copy, largest first (so the longest copy starts first)."""
    out = []
    for rel in rels:
        try:
            st = os.stat(src / rel, follow_symlinks=False)
        except OSError:
            continue  # left to rsync, which reports it
        if st.st_size >= PARALLEL_MIN_BYTES and not _excluded(rel, excludes) and os.path.isfile(src / rel):
            out.append((rel, st))
    return sorted(out, key=lambda x: -x[1].st_size)


class _Either:
    """Set when either event is: the caller's cancel, or this copy's own abort (one part failed)."""

    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def _copy_large(src: Path, dst: Path, rel: str, st: os.stat_result, link_dest: Path | None,
                cancel: _Either, abort: threading.Event):
    try:
        return _copy_one(src, dst, rel, st, link_dest, cancel)
    except BaseException:
        abort.set()  # stop rsync and the other threads: the copy has failed
        raise


def _copy_one(src: Path, dst: Path, rel: str, st: os.stat_result, link_dest: Path | None,
              cancel: _Either) -> tuple[int, tuple[tuple[int, int, int, int], str] | None]:
    """One file: skipped when in place, hard-linked from link_dest when unchanged there, else copied to a
    temp name (hashed block by block as it is read, each hashed block then written: _pipe_copy), fsynced
    and renamed. Returns (bytes copied,
    (stamp, sha256 of the copy) or None)."""
    target = dst / rel
    tmp = _temp_of(target)
    tmp.unlink(missing_ok=True)  # a killed attempt's
    if same_file(st, target):
        return 0, None  # a previous attempt's copy: checked against the manifest afterwards
    target.parent.mkdir(parents=True, exist_ok=True)
    if link_dest is not None and same_file(st, link_dest / rel) and _try_link(link_dest / rel, tmp):
        os.replace(tmp, target)
        return 0, None
    fin = os.open(src / rel, os.O_RDONLY)
    try:
        os.posix_fadvise(fin, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
        fout, direct = _open_target(tmp)
        try:
            done, digest = _pipe_copy(fin, fout, direct, cancel)
            if done != st.st_size:
                raise OSError(f"{src / rel}: {done} bytes copied, {st.st_size} expected (changed during the copy)")
            os.chmod(fout, st.st_mode & 0o7777)
            if os.geteuid() == 0:
                os.chown(fout, st.st_uid, st.st_gid)  # as rsync -a does for root
            os.utime(fout, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.fsync(fout)
            got = os.fstat(fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    os.replace(tmp, target)
    return done, ((got.st_dev, got.st_ino, got.st_size, got.st_mtime_ns), digest)


def _open_target(tmp: Path) -> tuple[int, bool]:
    """The temp file, opened for O_DIRECT writes where the filesystem takes them (tmpfs and some FUSE
    mounts refuse: buffered then). Returns (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(tmp, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(tmp, flags, 0o600), False


def _buffered(fout: int) -> None:
    fcntl.fcntl(fout, fcntl.F_SETFL, fcntl.fcntl(fout, fcntl.F_GETFL) & ~os.O_DIRECT)


def _pipe_copy(fin: int, fout: int, direct: bool, cancel: _Either) -> tuple[int, str]:
    """Copy fin to fout: a reader thread reads BUFFER-sized blocks and hashes each one in order, and
    WRITERS threads write the blocks already hashed at their offsets (DEPTH blocks in flight; hashlib,
    os.readv and os.pwrite release the GIL, so hashing overlaps the writes). The digest is that of the
    very buffers handed to the writes, as reading the copy back from the page cache would give. With
    O_DIRECT the blocks go from those buffers to the device: no second copy into the page cache and no
    writeback of it later (on 2 cores that copy and its writeback cost more CPU than sha256); several
    writers keep more than one block in flight at the device. The unaligned tail is written buffered."""
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for _ in range(DEPTH):
        free.put(mmap.mmap(-1, BUFFER))  # page-aligned, as O_DIRECT requires
    h, stop, errors = hashlib.sha256(), threading.Event(), []
    state = {"direct": direct, "end": 0}
    mode = threading.Lock()

    def fail(e: BaseException) -> None:
        errors.append(e)
        stop.set()
        free.put(None)  # wake the reader if it waits for a buffer

    def read() -> None:
        pos = 0
        try:
            while not stop.is_set():
                buf = free.get()
                if buf is None or stop.is_set():
                    return
                view, n = memoryview(buf), 0
                while n < BUFFER and (k := os.readv(fin, [view[n:]])):  # whole blocks: aligned offsets
                    n += k
                h.update(view[:n])
                if n:
                    full.put((buf, n, pos))
                pos += n
                if n < BUFFER:
                    state["end"] = pos
                    return  # end of file
        except BaseException as e:
            fail(e)
        finally:
            for _ in range(WRITERS):
                full.put(None)

    def unset_direct() -> None:
        with mode:
            if state["direct"]:
                _buffered(fout)
                state["direct"] = False

    def write() -> None:
        try:
            while (item := full.get()) is not None:
                if stop.is_set():
                    continue  # drain: the copy has failed
                if cancel.is_set():
                    raise OSError("cancelled")
                buf, n, pos = item
                view, off = memoryview(buf), 0
                while off < n:
                    if state["direct"] and (n - off) % ALIGN:
                        unset_direct()  # the file's last bytes: not a whole block
                    try:
                        off += os.pwrite(fout, view[off:n], pos + off)
                    except OSError as e:
                        if not (state["direct"] and e.errno == errno.EINVAL):
                            raise
                        unset_direct()  # a device block larger than ALIGN, or a filesystem that takes the
                                        # flag at open only: buffered from here on
                free.put(buf)
        except BaseException as e:
            fail(e)

    threads = [threading.Thread(target=read, name="copy-read", daemon=True)] + \
        [threading.Thread(target=write, name="copy-write", daemon=True) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if "cancelled" not in str(e)), errors[0])
    return state["end"], h.hexdigest()


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
    rels = list(rels)
    large = [] if bwlimit_kib else _large_files(src, rels, excludes)  # a bandwidth limit is rsync's to keep
    protect = {rel for rel, _ in large}
    abort = threading.Event()
    either = _Either(cancel, abort)
    stop = either if large else cancel
    with ThreadPoolExecutor(max_workers=min(COPY_WORKERS, len(large)) or 1, thread_name_prefix="copy") as pool:
        futures = [pool.submit(_copy_large, src, dst, rel, st, link_dest, either, abort) for rel, st in large]
        try:
            with TailHasher(dst, [r for r in rels if r not in protect]) as hasher:
                if shutil.which("rsync"):
                    n = _rsync(src, dst, link_dest, excludes, lock_fd, bwlimit_kib, stop, protect)
                else:
                    n = _pycopy(src, dst, link_dest, excludes, stop, protect)
        except BaseException as e:
            abort.set()
            for f in futures:
                f.cancel()
            raise _cause(futures) or e  # noqa: B904 - the failing thread's own error, not rsync's kill or a sibling's cancel
        if (cause := _cause(futures)) is not None:
            raise cause
        results = [f.result() for f in futures]
    digests = hasher.digests()
    for (rel, _), (copied, got) in zip(large, results):
        n += copied
        if got is not None and (st := _stat(dst / rel)) is not None and \
                (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == got[0]:
            digests[rel] = got[1]
    _fsync_tree(dst, done=digests)
    return n, digests


def _cause(futures: list) -> BaseException | None:
    """The first error of a large-file thread that is not a cancellation (one failing thread cancels the others,
    and the first of them in the list may report only that)."""
    errors = [x for f in futures if not f.cancelled() and (x := f.exception()) is not None]
    return next((x for x in errors if "cancelled" not in str(x)), errors[0] if errors else None)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None
