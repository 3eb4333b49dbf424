"""copytree's large-file pipeline: a reader that hashes each block, a writer with O_DIRECT where it is
taken, the unaligned tail written buffered, and a buffered fallback where O_DIRECT is refused."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading

import pytest

from orchestrator.store import copytree

BLOCK = 64 << 10  # small blocks: every size below crosses block boundaries the way multi-GiB shards do


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(copytree, "BUFFER", BLOCK)


def copy(tmp_path, size: int, name: str = "f.bin") -> tuple[bytes, int, str, os.stat_result]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(exist_ok=True)
    data = os.urandom(size)
    (src / name).write_bytes(data)
    st = (src / name).stat()
    done, got = copytree._copy_one(src, dst, name, st, None, copytree._Either(threading.Event()))
    return data, done, got[1], st


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 4096 + 123])
def test_copy_is_exact_and_its_digest_is_the_copys(tmp_path, size):
    data, done, digest, st = copy(tmp_path, size)
    out = tmp_path / "dst" / "f.bin"
    assert done == size and out.read_bytes() == data
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    assert out.stat().st_mtime_ns == st.st_mtime_ns and not (tmp_path / "dst" / ".f.bin.orch-partial").exists()


def test_direct_io_is_used_where_the_filesystem_takes_it(tmp_path, monkeypatch):
    """On a disk filesystem (ext4, xfs) the writes bypass the page cache; tmpfs refuses O_DIRECT."""
    seen = []
    real = copytree._open_target
    monkeypatch.setattr(copytree, "_open_target", lambda p: seen.append(real(p)) or seen[-1])
    data, done, digest, _ = copy(tmp_path, 2 * BLOCK + 10)
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        takes_direct = True
    except OSError:
        takes_direct = False
    assert seen[0][1] is takes_direct
    assert (tmp_path / "dst" / "f.bin").read_bytes() == data


def test_refused_at_open_falls_back_to_buffered(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(copytree.os, "open", no_direct)
    data, done, digest, _ = copy(tmp_path, 3 * BLOCK + 5)
    assert (tmp_path / "dst" / "f.bin").read_bytes() == data and done == len(data)


def test_refused_at_write_falls_back_to_buffered(tmp_path, monkeypatch):
    """A filesystem that takes the flag at open but not the writes (EINVAL): buffered from then on."""
    real_pwrite, calls = os.pwrite, []

    def picky(fd, buf, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls.append(len(buf))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)
    monkeypatch.setattr(copytree.os, "pwrite", picky)
    data, done, digest, _ = copy(tmp_path, 2 * BLOCK)
    assert (tmp_path / "dst" / "f.bin").read_bytes() == data
    assert digest == hashlib.sha256(data).hexdigest()
    takes_direct_at_open = copytree._open_target(tmp_path / "probe")
    os.close(takes_direct_at_open[0])
    assert bool(calls) is takes_direct_at_open[1]  # the refusal was met (on a filesystem that takes the flag)


def test_a_read_error_fails_the_copy_and_stops_the_writer(tmp_path, monkeypatch):
    real_readv, reads = os.readv, []

    def failing(fd, bufs):
        reads.append(fd)
        if len(reads) > 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_readv(fd, bufs)
    monkeypatch.setattr(copytree.os, "readv", failing)
    with pytest.raises(OSError, match="Input/output error"):
        copy(tmp_path, 8 * BLOCK)
    assert [t for t in threading.enumerate() if t.name in ("copy-read", "copy-write")] == []


def test_a_write_error_fails_the_copy_with_its_own_error(tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def full(fd, buf, offset):
        if offset >= 2 * BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, offset)
    monkeypatch.setattr(copytree.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        copy(tmp_path, 16 * BLOCK)
    assert [t for t in threading.enumerate() if t.name in ("copy-read", "copy-write")] == []
