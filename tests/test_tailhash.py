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
from test_checkpoints import make_swift

from orchestrator import copytree
from orchestrator import manifest as mf
from orchestrator import sync
from orchestrator.tailhash import TailHasher


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
