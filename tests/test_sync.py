"""Publishing checkpoints to persistent storage: real files, real rsync (and the pure-Python fallback)."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_dirs import make_megatron, make_merged, make_swift

from orchestrator.store import checkpoints as ck
from orchestrator.store import copytree, sync
from orchestrator.store import sync_thread
from orchestrator.store.sync_thread import SyncThread, until_due
from orchestrator.store import manifest as mf

REPO = Path(__file__).resolve().parents[1]
HAS_RSYNC = sync.shutil.which("rsync") is not None
needs_rsync = pytest.mark.skipif(not HAS_RSYNC, reason="rsync not installed (apt-get install -y rsync)")


@pytest.fixture(params=["rsync", "python", "parallel"])
def copier(request, monkeypatch):
    """Run a test with rsync, with the pure-Python fallback, and with every file copied by copytree's
    threads beside rsync (the path of a real checkpoint's multi-GiB shards)."""
    if request.param in ("rsync", "parallel") and not HAS_RSYNC:
        pytest.skip("rsync not installed")
    if request.param == "python":
        monkeypatch.setattr(sync.shutil, "which", lambda name, *a, **k: None)
    if request.param == "parallel":
        monkeypatch.setattr(copytree, "PARALLEL_MIN_BYTES", 1)
    return request.param


def published(p: Path) -> list[str]:
    return sorted(e.name for e in p.iterdir() if not e.name.startswith(".orchestrator-sync"))


def inodes(d: Path) -> dict[str, tuple[int, int]]:
    return {r: ((d / r).stat().st_ino, (d / r).stat().st_mtime_ns) for r in mf.list_files(d)}


def test_publish_then_resync_copies_nothing(tmp_path, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    for s in (10, 20, 30):
        make_swift(out, s)
    r = sync.sync_once(out, pers, "swift", "h1")
    # only the newest: the two older ones are superseded, never copied
    assert r.ok and r.synced and r.copied == ("checkpoint-30",) and published(pers) == ["checkpoint-30"]
    assert {s for s in r.skipped if "superseded by checkpoint-30" in s} == {
        "checkpoint-10: superseded by checkpoint-30 (only the newest is published)",
        "checkpoint-20: superseded by checkpoint-30 (only the newest is published)"}
    assert r.bytes_copied > 0 and r.lag_steps == 0 and r.lag_s == 0.0 and r.newest_published == 30
    local, pub = out / "checkpoint-30", pers / "checkpoint-30"
    m = mf.read_manifest(local)
    assert m["recipe_hash"] == "h1" and m["step"] == 30  # the manifest was written locally on verification
    assert sync.same_content(m, mf.read_manifest(pub)) and mf.manifest_matches(pub, m) == []
    assert ck.verify(pub, backend="swift").ok  # trainer_state.json is the marker in the copy
    before = inodes(pers / "checkpoint-30")
    r2 = sync.sync_once(out, pers, "swift", "h1")
    assert r2.ok and r2.copied == () and r2.bytes_copied == 0 and r2.deleted == ()
    assert inodes(pers / "checkpoint-30") == before


@needs_rsync
def test_unchanged_files_are_hard_linked_to_the_previous_copy(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    sync.sync_once(out, pers, "swift", "h")
    d20 = make_swift(out, 20)
    os.utime(d20 / "README.md", ns=((out / "checkpoint-10" / "README.md").stat().st_mtime_ns,) * 2)
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.copied == ("checkpoint-20",)
    a, b = pers / "checkpoint-10" / "README.md", pers / "checkpoint-20" / "README.md"
    assert a.stat().st_ino == b.stat().st_ino  # --link-dest
    assert mf.manifest_matches(pers / "checkpoint-10", mf.read_manifest(pers / "checkpoint-10")) == []


def test_only_verified_checkpoints_are_published(tmp_path, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    bad = make_swift(out, 20)
    (bad / "adapter_model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b'{"__metadata__":{}}' * 2)
    make_swift(out, 30, link=False, state=False)  # still being written
    alerts = []
    r = sync.sync_once(out, pers, "swift", "h", on_problem=alerts.append)
    assert published(pers) == ["checkpoint-10"]
    assert alerts == list(r.problems) and len(alerts) == 1 and alerts[0].startswith("local checkpoint-20/")
    assert any("checkpoint-30: still being written" in s for s in r.skipped)
    assert r.synced  # a corrupt local checkpoint is an alert, not a failed publication
    assert mf.read_manifest(bad) is None and mf.read_manifest(out / "checkpoint-30") is None


def test_retention_keeps_newest_and_best_loss(tmp_path, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    losses = {10: 5.0, 20: 1.0, 30: 4.0, 40: 3.0, 50: 2.0}
    deleted = []
    for s, loss in losses.items():  # a round after each save: each is the newest when published
        make_swift(out, s, loss=loss)
        deleted += sync.sync_once(out, pers, "swift", "h", keep=2).deleted
    assert published(pers) == ["checkpoint-20", "checkpoint-40", "checkpoint-50"]
    assert deleted == ["checkpoint-10", "checkpoint-30"]
    assert mf.read_manifest(pers / "checkpoint-20")["loss"] == 1.0
    make_swift(out, 60, loss=0.5)
    r = sync.sync_once(out, pers, "swift", "h", keep=2)
    assert r.copied == ("checkpoint-60",) and set(r.deleted) == {"checkpoint-20", "checkpoint-40"}
    assert published(pers) == ["checkpoint-50", "checkpoint-60"]
    # keep=0 still never deletes the newest good copy
    sync.sync_once(out, pers, "swift", "h", keep=0)
    assert published(pers) == ["checkpoint-60"]


@pytest.mark.parametrize("steps,keep,want", [
    ({1: None, 2: None, 3: None}, 2, {2, 3}),
    ({1: 0.1, 2: 0.5, 3: 0.9}, 1, {1, 3}),
    ({1: 0.1, 2: float("nan"), 3: 0.9}, 0, {1, 3}),
    ({1: 0.5, 2: 0.5}, 1, {2}),
    ({}, 3, set()),
])
def test_retain_table(steps, keep, want):
    assert sync.retain(steps, keep) == want


def test_merged_and_mcore_selection(tmp_path, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_megatron(out, 100)
    make_merged(out, 100)
    r = sync.sync_once(out, pers, "megatron", "h", include_mcore=False)
    assert r.ok and set(r.copied) == {"checkpoint-100", "checkpoint-100-merged"}
    assert not list((pers / "checkpoint-100").rglob("*.distcp"))
    assert (pers / "checkpoint-100" / "iter_0000100" / "common.pt").is_file()  # resume still reads the iteration
    assert mf.read_manifest(pers / "checkpoint-100")["excluded"] == [sync.MCORE_SHARDS]
    assert ck.verify(pers / "checkpoint-100", backend="megatron").ok
    assert ck.verify(pers / "checkpoint-100-merged", backend="megatron").ok
    assert sync.sync_once(out, pers, "megatron", "h", include_mcore=False).copied == ()
    r = sync.sync_once(out, pers, "megatron", "h")  # now with shards: the copy is republished whole
    assert r.copied == ("checkpoint-100",) and list((pers / "checkpoint-100").rglob("*.distcp"))
    deleted = []
    for s in (200, 300, 400):
        make_megatron(out, s)
        deleted += sync.sync_once(out, pers, "megatron", "h", keep=3, include_merged=False).deleted
    assert set(deleted) == {"checkpoint-100", "checkpoint-100-merged"}  # the merged copy goes with its step
    assert published(pers) == ["checkpoint-200", "checkpoint-300", "checkpoint-400"]


def test_changed_local_checkpoint_is_republished(tmp_path, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    d = make_swift(out, 10)
    sync.sync_once(out, pers, "swift", "h")
    old = (d / mf.MANIFEST).stat().st_mtime_ns - 10**9  # coarse-mtime filesystems: make "later" unambiguous
    os.utime(d / mf.MANIFEST, ns=(old, old))
    (d / "optimizer.pt").write_bytes(os.urandom(2048))  # re-saved after a resume from an earlier step
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.copied == ("checkpoint-10",)
    assert (pers / "checkpoint-10" / "optimizer.pt").read_bytes() == (d / "optimizer.pt").read_bytes()
    assert published(pers) == ["checkpoint-10"]


def test_unwritable_persistent_dir_is_a_problem_not_a_traceback(tmp_path):
    out = tmp_path / "out"
    make_swift(out, 10)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory is expected")
    for pers in (blocker, blocker / "sub"):
        got = []
        r = sync.sync_once(out, pers, "swift", "h", on_problem=got.append)
        assert not r.ok and not r.synced and got == list(r.problems)
        assert r.problems[0].startswith(f"persistent_dir {pers} is not writable")
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        r = sync.sync_once(out, ro / "p", "swift", "h")
        assert "not writable" in r.problems[0]


def test_full_disk_leaves_nothing_partial(tmp_path, monkeypatch, copier):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(sync.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 5 << 20))
    got = []
    r = sync.sync_once(out, pers, "swift", "h", on_problem=got.append)
    assert not r.synced and r.copied == () and got == list(r.problems)
    assert r.problems == (f"persistent_dir {pers} has 0.0 GiB free, needs 0.3 GiB: free space or lower retention",)
    assert published(pers) == []  # nothing partial, nothing published
    assert r.lag_steps is None and r.lag_s is not None and r.newest_local == 10


def test_full_disk_prunes_what_retention_drops_anyway(tmp_path, monkeypatch):
    out, pers = tmp_path / "out", tmp_path / "pers"
    for s in (10, 20, 30):
        make_swift(out, s, loss=s / 10)
        sync.sync_once(out, pers, "swift", "h", keep=3)
    make_swift(out, 40, loss=4.0)

    def usage(p):  # full until checkpoint-20 is gone
        free = 5 << 20 if (pers / "checkpoint-20").exists() else 100 << 30
        return namedtuple("U", "total used free")(1 << 40, 0, free)
    monkeypatch.setattr(sync.shutil, "disk_usage", usage)
    r = sync.sync_once(out, pers, "swift", "h", keep=3)
    # keep=3 plus the best loss (10) keeps every published copy: the publish fails cleanly
    assert "GiB free" in r.problems[0] and r.deleted == ()
    assert published(pers) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    r = sync.sync_once(out, pers, "swift", "h", keep=2)  # 20 is dropped anyway: drop it first
    assert r.ok and r.copied == ("checkpoint-40",) and r.deleted == ("checkpoint-20",)
    assert published(pers) == ["checkpoint-10", "checkpoint-30", "checkpoint-40"]


def test_lock_and_stale_partials(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    pers.mkdir()
    (pers / ".partial-checkpoint-5").mkdir()
    (pers / ".partial-deleting-checkpoint-1-99").mkdir()
    fd = os.open(pers / sync.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = sync.sync_once(out, pers, "swift", "h")
        assert "another sync holds" in r.problems[0] and not r.synced
    finally:
        os.close(fd)
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.ok and published(pers) == ["checkpoint-10"]


def test_python_fallback_resumes_staging(tmp_path, monkeypatch):
    monkeypatch.setattr(sync.shutil, "which", lambda *a, **k: None)
    out, pers = tmp_path / "out", tmp_path / "pers"
    d = make_swift(out, 10, big=1 << 20)
    mf.write_manifest(d, 10, "h")
    staging = pers / ".partial-checkpoint-10"
    staging.mkdir(parents=True)
    import shutil
    shutil.copy2(d / "optimizer.pt", staging / "optimizer.pt")  # finished before the kill
    (staging / ".rng_state.pth.orch-tmp").write_bytes(b"half")  # in flight at the kill
    (staging / "stray").write_bytes(b"x")
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.ok and r.copied == ("checkpoint-10",)
    total = sum(f["size"] for f in mf.read_manifest(d)["files"])
    assert r.bytes_copied == total - (1 << 20)
    assert mf.list_files(pers / "checkpoint-10") == mf.list_files(d)


KILL_SCRIPT = textwrap.dedent("""
    import sys
    from orchestrator.store.sync import sync_once
    sync_once(sys.argv[1], sys.argv[2], "swift", "h", bwlimit_kib=4096)
""")


@needs_rsync
def test_kill_mid_copy_leaves_no_visible_partial_and_resumes(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    size = 4 << 20
    d = make_swift(out, 10, big=size)  # optimizer.pt, then rng_state.pth, each ~1 s at 4 MiB/s
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(out), str(pers)], env=env,
                            start_new_session=True)
    done = pers / ".partial-checkpoint-10" / "optimizer.pt"
    deadline = time.monotonic() + 60
    try:
        while not (done.exists() and done.stat().st_size == size):
            assert proc.poll() is None, "sync finished before it could be killed"
            assert time.monotonic() < deadline, "staging never appeared"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its rsync die together, as on a spot loss
        proc.wait()
    assert published(pers) == [".partial-checkpoint-10"]  # no visible checkpoint
    assert not any(ck.CKPT_RE.fullmatch(n) for n in os.listdir(pers))
    # the killed rsync processes inherited the lock; it frees once the kernel has reaped them all
    fd = os.open(pers / sync.LOCK, os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "lock never released"
                time.sleep(0.02)
    finally:
        os.close(fd)
    r = sync.sync_once(out, pers, "swift", "h")
    assert r.ok and r.copied == ("checkpoint-10",) and published(pers) == ["checkpoint-10"]
    total = sum(f["size"] for f in mf.read_manifest(d)["files"])
    assert r.bytes_copied <= total - size  # optimizer.pt was not copied again
    assert mf.manifest_matches(pers / "checkpoint-10", mf.read_manifest(d)) == []


def test_restore(tmp_path, copier):
    out, pers, fresh = tmp_path / "out", tmp_path / "pers", tmp_path / "fresh"
    for s in (10, 20):
        make_swift(out, s)
        sync.sync_once(out, pers, "swift", "h")
    make_merged(out, 20)
    sync.sync_once(out, pers, "swift", "h")
    p = sync.restore(pers, fresh, None, include_merged=True)
    assert p == fresh / "checkpoint-20" and (fresh / "checkpoint-20-merged").is_dir()
    assert [i.step for i in ck.discover(fresh, "swift") if i.ok] == [20]
    assert sync.restore(pers, fresh, 20) == p  # already there and identical: nothing to do
    assert sync.restore(pers, fresh, 10) == fresh / "checkpoint-10"
    assert not [n for n in os.listdir(fresh) if n.startswith(".partial-")]
    with pytest.raises(sync.SyncError, match="no published checkpoint-30"):
        sync.restore(pers, fresh, 30)
    (fresh / "checkpoint-10" / "scheduler.pt").write_bytes(b"other")
    with pytest.raises(sync.SyncError, match="exists and differs"):
        sync.restore(pers, fresh, 10)
    raw = bytearray((pers / "checkpoint-20" / "optimizer.pt").read_bytes())
    raw[0] ^= 1
    (pers / "checkpoint-20" / "optimizer.pt").write_bytes(bytes(raw))
    with pytest.raises(sync.SyncError, match="sha256 differs"):
        sync.restore(pers, tmp_path / "fresh2", 20)
    assert not (tmp_path / "fresh2" / "checkpoint-20").exists()
    assert not (tmp_path / "fresh2" / ".partial-checkpoint-20").exists()


def test_publisher_thread_timer_trigger_alerts_and_stop(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    alerts = []
    car = SyncThread(out, pers, "swift", "h", interval_s=3600, on_problem=alerts.append)
    car.start()
    assert car.wait_rounds(1, timeout=30)
    assert car.last_result.copied == ("checkpoint-10",) and car.last_success_at and car.bytes_total > 0
    bad = make_swift(out, 20)
    (bad / "adapter_model.safetensors").write_bytes(b"")
    car.trigger()
    assert car.wait_rounds(2, timeout=30)
    car.trigger()
    assert car.wait_rounds(3, timeout=30)
    assert len(alerts) == 1 and "checkpoint-20" in alerts[0]  # alerted once, not every round
    make_swift(out, 30)
    car.stop(timeout=30, final_sync=True)
    assert not car.is_alive() and car.rounds == 4
    assert "checkpoint-30" in published(pers)


def test_publisher_thread_survives_exceptions(tmp_path, monkeypatch):
    calls = threading.Semaphore(0)

    def boom(*a, **k):
        calls.release()
        raise RuntimeError("disk exploded")
    monkeypatch.setattr(sync_thread, "sync_once", boom)
    alerts = []
    car = SyncThread(tmp_path, tmp_path / "p", "swift", "h", interval_s=3600, on_problem=alerts.append)
    car.start()
    assert car.wait_rounds(1, timeout=30)
    car.trigger()
    assert car.wait_rounds(2, timeout=30) and car.is_alive()
    assert car.last_result.problems == ("sync crashed: RuntimeError: disk exploded",)
    assert alerts == ["sync crashed: RuntimeError: disk exploded"] and car.last_success_at is None
    car.stop(timeout=30)
    assert not car.is_alive()


@pytest.mark.parametrize("last, interval, now, want", [
    (None, 1800, 5.0, 0.0),         # nothing copied yet: due now
    (100.0, 1800, 700.0, 1200.0),   # copied 600 s ago: 1200 s to go
    (100.0, 1800, 1900.0, 0.0),     # exactly due
    (100.0, 1800, 5000.0, 0.0),     # overdue
    (100.0, 0, 100.5, 0.0),         # 0: every verified save
])
def test_until_due(last, interval, now, want):
    assert until_due(last, interval, now) == want


def test_publisher_thread_publishes_the_newest_at_most_every_publish_interval(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    car = SyncThread(out, pers, "swift", "h", interval_s=3600, publish_interval_s=3600)
    car.start()
    assert car.wait_rounds(1, timeout=30) and car.last_result.copied == ("checkpoint-10",)
    for s in (20, 30):
        make_swift(out, s)
        car.trigger()
    assert not car.wait_rounds(2, timeout=0.5)  # held: the round that copied started under an hour ago
    assert published(pers) == ["checkpoint-10"]
    car.stop(timeout=30, final_sync=True)  # the final round is never held
    assert not car.is_alive() and car.rounds == 2 and car.last_result.copied == ("checkpoint-30",)
    assert published(pers) == ["checkpoint-10", "checkpoint-30"]  # checkpoint-20: superseded, never copied


def test_publisher_thread_stop_before_start_and_interval(tmp_path):
    make_swift(tmp_path / "out", 10)
    car = SyncThread(tmp_path / "out", tmp_path / "p", "swift", "h", interval_s=0.05)
    car.start()
    assert car.wait_rounds(3, timeout=30)  # the timer alone drives rounds
    car.stop(timeout=30)
    assert not car.is_alive()
    SyncThread(tmp_path, tmp_path / "q", "swift", "h").stop()  # never started: no error


def test_manifest_json_is_what_we_expect(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10, loss=0.75)
    sync.sync_once(out, pers, "swift", "rh")
    m = json.loads((pers / "checkpoint-10" / mf.MANIFEST).read_text())
    assert set(m) >= {"step", "recipe_hash", "created_at", "loss", "files"} and m["loss"] == 0.75
    assert all(set(f) == {"path", "size", "sha256"} for f in m["files"])
    assert (pers / sync.LOCK).exists()  # the lock file stays; it is never a checkpoint


@needs_rsync
def test_publisher_thread_stop_cancels_a_long_copy(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10, big=8 << 20)  # ~8 s at 1 MiB/s
    alerts = []
    car = SyncThread(out, pers, "swift", "h", interval_s=3600, on_problem=alerts.append, bwlimit_kib=1024)
    car.start()
    staging = pers / ".partial-checkpoint-10"
    deadline = time.monotonic() + 30
    while not staging.exists():
        assert time.monotonic() < deadline and car.rounds == 0
        time.sleep(0.02)
    t = time.monotonic()
    car.stop(timeout=30, cancel=True)
    assert not car.is_alive() and time.monotonic() - t < 5
    assert car.last_result.skipped == ("checkpoint-10: cancelled by stop()",) and alerts == []
    assert published(pers) == [".partial-checkpoint-10"]  # kept for the next round to resume


@pytest.mark.parametrize("a,b,same", [
    ({"step": 1, "files": [{"path": "x", "size": 1, "sha256": "a"}]},
     {"step": 1, "files": [{"path": "x", "size": 1, "sha256": "a"}], "created_at": 5, "loss": 2}, True),
    ({"step": 1, "files": [{"path": "x", "size": 1, "sha256": "a"}]},
     {"step": 1, "files": [{"path": "x", "size": 1, "sha256": "b"}]}, False),
    ({"step": 1, "files": []}, {"step": 2, "files": []}, False),
    ({"step": 1, "files": []}, None, False),
    ({"step": 1, "files": [{"path": "x"}]}, {"step": 1, "files": [{"path": "x"}]}, False),
])
def test_same_content_table(a, b, same):
    assert sync.same_content(a, b) is same


def test_restore_failures_are_sync_errors(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_swift(out, 10)
    sync.sync_once(out, pers, "swift", "h")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(sync.SyncError, match="cannot create output_dir"):
        sync.restore(pers, blocker / "out", 10)
    with pytest.raises(sync.SyncError, match="cannot read persistent_dir"):
        sync.restore(tmp_path / "missing", tmp_path / "o", 10)
    (pers / "checkpoint-10" / mf.MANIFEST).unlink()
    with pytest.raises(sync.SyncError, match="cannot be verified"):
        sync.restore(pers, tmp_path / "o", 10)
