"""Hashing a staging dir while it is written: follows rsync's temp file through its rename, never trusts a
digest of a file that changed afterwards, and the publish check still compares every digest."""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_dirs import make_swift

from orchestrator.store import copytree, sync
from orchestrator.store import manifest as mf
from orchestrator.store.tailhash import TailHasher


def wait_until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def opened_by_us(path: Path) -> bool:
    fds = Path("/proc/self/fd")
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == os.path.realpath(path):
                return True
        except OSError:
            pass
    return False


def test_follows_a_growing_temp_file_through_its_rename(tmp_path):
    temp, final = tmp_path / ".opt.pt.Ab12Cd", tmp_path / "opt.pt"
    parts = [os.urandom(3 << 20), os.urandom(5 << 20 | 123)]
    temp.write_bytes(parts[0])
    with TailHasher(tmp_path, ["opt.pt"]) as hasher:
        wait_until(lambda: opened_by_us(temp))  # the thread is following the temp file
        with open(temp, "ab") as f:
            f.write(parts[1])
        os.utime(temp, ns=(1, 2))  # rsync sets the times before the rename
        os.rename(temp, final)
    assert hasher.digests() == {"opt.pt": hashlib.sha256(b"".join(parts)).hexdigest()}


def test_a_temp_file_rsync_drops_gives_no_digest(tmp_path):
    temp = tmp_path / ".opt.pt.Xy34Zw"
    temp.write_bytes(os.urandom(1 << 20))
    with TailHasher(tmp_path, ["opt.pt"]) as hasher:
        wait_until(lambda: opened_by_us(temp))
        temp.unlink()  # rsync failed or was cancelled
    assert hasher.digests() == {}
    assert not opened_by_us(temp)


@pytest.mark.parametrize("change", ["replaced by rename", "rewritten in place"])
def test_a_file_changed_after_hashing_loses_its_digest(tmp_path, change):
    (tmp_path / "sub").mkdir()
    a, b = tmp_path / "sub" / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 4096)
    b.write_bytes(b"y" * 10)
    with TailHasher(tmp_path, ["sub/a.bin", "b.bin"]) as hasher:
        wait_until(lambda: len(hasher.digests()) == 2)
    assert hasher.digests()["sub/a.bin"] == hashlib.sha256(b"x" * 4096).hexdigest()
    if change == "replaced by rename":
        (tmp_path / "sub" / ".a.bin.new").write_bytes(b"z" * 4096)
        os.rename(tmp_path / "sub" / ".a.bin.new", a)
    else:
        with open(a, "r+b") as f:
            f.write(b"z")
        os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 1))
    assert set(hasher.digests()) == {"b.bin"}


def test_manifest_check_hashes_only_what_it_was_not_given(tmp_path, monkeypatch):
    d = make_swift(tmp_path / "out", 10)
    m = mf.build_manifest(d, 10, "h")
    given = {m["files"][0]["path"]: m["files"][0]["sha256"]}
    hashed = []
    real = mf._hash_all
    monkeypatch.setattr(mf, "_hash_all", lambda paths: hashed.extend(paths) or real(paths))
    assert mf.manifest_matches(d, m, known=given) == []
    assert sorted(hashed) == sorted(d / f["path"] for f in m["files"][1:])
    bad = {m["files"][0]["path"]: "0" * 64}
    assert "sha256 differs" in mf.manifest_matches(d, m, known=bad)[0]


def test_publish_compares_the_digests_taken_during_the_copy(tmp_path, monkeypatch):
    make_swift(tmp_path / "out", 10)
    wrong = lambda self: {"adapter_model.safetensors": "0" * 64}  # noqa: E731  (a copy damaged on its way)
    monkeypatch.setattr(copytree.TailHasher, "digests", wrong)
    r = sync.sync_once(tmp_path / "out", tmp_path / "pers", "swift", "h")
    assert not r.ok and "does not match its manifest" in r.problems[0]
    assert not (tmp_path / "pers" / "checkpoint-10").exists()


def test_a_failed_copy_does_not_wait_for_hashing(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB of zeros to read, far longer than the test takes
    with pytest.raises(OSError):
        with TailHasher(tmp_path, ["big.bin"]) as hasher:
            wait_until(lambda: opened_by_us(big))
            raise OSError("rsync exit 20: cancelled")
    assert hasher.digests() == {} and not opened_by_us(big)


# --- large files copied by copytree's threads beside rsync ------------------------------------------

@pytest.fixture
def threads_copy(monkeypatch):
    """Files of 1 MiB and more go to copytree's threads (real checkpoints: shards of 64 MiB and more)."""
    monkeypatch.setattr(copytree, "PARALLEL_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(copytree, "BUFFER", 256 << 10)


def test_threads_copy_large_files_hash_them_once_and_clear_a_killed_attempt(tmp_path, monkeypatch, threads_copy):
    out, pers = tmp_path / "out", tmp_path / "pers"
    d = make_swift(out, 10, big=3 << 20)  # optimizer.pt and rng_state.pth go to the threads
    mf.write_manifest(d, 10, "h")
    staging = pers / ".partial-checkpoint-10"
    staging.mkdir(parents=True)
    (staging / ".optimizer.pt.orch-partial").write_bytes(b"half")  # a killed attempt's, thread and rsync
    (staging / ".scheduler.pt.Ab12Cd").write_bytes(b"half")
    (staging / "stray").write_bytes(b"x")
    hashed, by_threads = [], []
    real, real_copy = mf._hash_all, copytree._copy_one
    monkeypatch.setattr(mf, "_hash_all", lambda paths: hashed.extend(paths) or real(paths))
    monkeypatch.setattr(copytree, "_copy_one", lambda src, dst, rel, *a: by_threads.append(rel) or
                        real_copy(src, dst, rel, *a))
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.ok and r.copied == ("checkpoint-10",)
    assert sorted(by_threads) == ["optimizer.pt", "rng_state.pth"]
    assert r.bytes_copied == sum(f["size"] for f in mf.read_manifest(d)["files"])
    pub = pers / "checkpoint-10"
    # the threads' digests are the publish check's: the large files are not read a second time
    assert not {"optimizer.pt", "rng_state.pth"} & {Path(p).name for p in hashed}
    assert mf.list_files(pub) == mf.list_files(d)  # leftovers gone, nothing extra
    assert mf.manifest_matches(pub, mf.read_manifest(d)) == []
    for rel in ("optimizer.pt", "rng_state.pth"):  # as rsync -a: same mtime and mode, so the next round skips
        a, b = (d / rel).stat(), (pub / rel).stat()
        assert (a.st_mtime_ns, a.st_mode) == (b.st_mtime_ns, b.st_mode)
    assert sync.sync_once(out, pers, "swift", "h").copied == ()
    make_swift(out, 20, big=3 << 20)
    (out / "checkpoint-20" / "optimizer.pt").write_bytes((d / "optimizer.pt").read_bytes())
    st = (d / "optimizer.pt").stat()
    os.utime(out / "checkpoint-20" / "optimizer.pt", ns=(st.st_atime_ns, st.st_mtime_ns))
    r = sync.sync_once(out, pers, "swift", "h")  # unchanged large file: hard-linked, as rsync --link-dest does
    assert r.ok and r.copied == ("checkpoint-20",)
    assert (pers / "checkpoint-20" / "optimizer.pt").stat().st_ino == (pub / "optimizer.pt").stat().st_ino


def test_a_failing_thread_fails_the_copy_with_its_own_error(tmp_path, monkeypatch, threads_copy):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10, big=3 << 20)
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):
        if offset >= 1 << 20:  # a full disk part-way through a large file
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(copytree.os, "pwrite", full_disk)
    r = sync.sync_once(out, pers, "swift", "h")
    assert not r.ok and "No space left on device" in r.problems[0], r.problems
    assert not (pers / "checkpoint-10").exists()
    assert not (pers / ".partial-checkpoint-10").exists()  # ENOSPC: the space is wanted back


def test_cancel_stops_the_threads_mid_file(tmp_path, threads_copy):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    with open(src / "big.bin", "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB to read, far longer than the test takes
    cancel = __import__("threading").Event()
    cancel.set()
    t = time.monotonic()
    with pytest.raises(OSError, match="cancelled"):
        copytree.copy_tree(src, dst, ["big.bin"], None, (), None, None, cancel)
    assert time.monotonic() - t < 10 and not (dst / "big.bin").exists()
