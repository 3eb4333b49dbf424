"""The journal under faults, on real SQLite files: what diagnose() calls damage (and what it must not), the move
aside, and writes held while the journal's place refuses them (a lock, a read-only file)."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.recipe import RecipeError
from orchestrator.host import journal as J
from orchestrator.host.journal import Journal
from orchestrator.host.journal_health import DAMAGED, diagnose, move_aside, open_journal
from orchestrator.types import Attempt


def healthy(path: Path) -> Path:
    j = Journal(path)
    j.record_attempt(Attempt(1, 10.0, ended_at=20.0))
    for i in range(300):  # enough pages for a truncation to cut into the tables
        j.event("note", f"event {i} " + "x" * 200)
    j.put(state="running", recipe_hash="h")
    j.close()
    return path


def _sql(statements: str):
    def fault(path: Path) -> None:
        db = sqlite3.connect(path)
        db.executescript(statements)
        db.close()
    return fault


def _truncate(path: Path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _zero(path: Path) -> None:
    os.truncate(path, 0)


def _foreign(path: Path) -> None:
    path.unlink()
    _sql("CREATE TABLE photos (id INTEGER, blob BLOB);")(path)


# (fault, the words diagnose() must say); None: not damage, the journal reads (false-positive rows)
DIAGNOSE = [
    ("garbage bytes", _garbage, "file is not a database"),
    ("truncated", _truncate, "malformed"),
    ("zero bytes", _zero, "zero bytes"),
    ("newer release", _sql("PRAGMA user_version = 99;"), "newer release"),
    ("table lacks columns", _sql("DROP TABLE attempts; CREATE TABLE attempts (x INTEGER);"), "lacks column"),
    ("table is a view", _sql("DROP TABLE kv; CREATE VIEW kv AS SELECT 1 AS key, 2 AS value;"), "is a view"),
    ("another program's database", _foreign, "not an orchestrator journal"),
    ("a kv value not JSON", _sql("UPDATE kv SET value = '{not json' WHERE key = 'state';"), "unreadable rows"),
    ("an unknown crash class", _sql("UPDATE attempts SET cls = 'no_such_class';"), "unreadable rows"),
    ("healthy", lambda p: None, None),
    ("a table missing", _sql("DROP TABLE spans;"), "no table spans"),
    ("an empty SQLite database", lambda p: (p.unlink(), _sql("PRAGMA user_version = 0;")(p)), "no tables"),
    ("an older journal without the later columns",
     _sql("CREATE TABLE c2 AS SELECT step, path, ok, problems, loss, recipe_hash, verified_at, "
          "synced_at FROM checkpoints; DROP TABLE checkpoints; ALTER TABLE c2 RENAME TO checkpoints;"
          "PRAGMA user_version = 0;"), None),
    ("another process holds the write lock", "locked", None),
]


@pytest.mark.parametrize("name,fault,says", DIAGNOSE, ids=[row[0] for row in DIAGNOSE])
def test_diagnose(tmp_path, name, fault, says):
    path = healthy(tmp_path / "journal.sqlite")
    if fault == "locked":
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            assert diagnose(path) is None
        finally:
            other.close()
        return
    fault(path)
    got = diagnose(path)
    if says is None:
        assert got is None
    else:
        assert got is not None and says in got, got


@pytest.mark.parametrize("fault", [_garbage, _truncate, _zero, _sql("PRAGMA user_version = 99;")],
                         ids=["garbage", "truncated", "zero", "newer"])
def test_open_journal_moves_a_damaged_one_aside_and_starts_a_new_one(tmp_path, fault):
    path = healthy(tmp_path / "journal.sqlite")
    fault(path)
    before = path.read_bytes()
    Path(f"{path}-wal").write_bytes(b"a stale write-ahead log")  # must not be read into the new journal
    j, damage = open_journal(path, clock=lambda: 1_700_000_000.0)
    try:
        assert damage is not None and damage.path == path and damage.problem
        assert damage.moved_to == path.with_name(f"journal.sqlite{DAMAGED}20231114T221320Z")
        assert damage.moved_to.read_bytes() == before, "moved, never changed or deleted"
        assert Path(f"{damage.moved_to}-wal").read_bytes() == b"a stale write-ahead log"
        assert j.get_all() == {} and j.attempts() == []
        j.event("x", "the new journal takes writes")
    finally:
        j.close()
    assert diagnose(path) is None


def test_open_journal_keeps_a_healthy_one(tmp_path):
    path = healthy(tmp_path / "journal.sqlite")
    j, damage = open_journal(path)
    try:
        assert damage is None and j.get_all()["state"] == "running"
    finally:
        j.close()
    assert [p.name for p in tmp_path.iterdir()] == ["journal.sqlite"]


def test_two_moves_in_one_second_keep_both(tmp_path):
    first, second = tmp_path / "journal.sqlite", None
    for _ in range(2):
        first.write_bytes(b"garbage")
        second = move_aside(first, 0.0)
    assert second is not None and second.name.endswith(".2") and len(list(tmp_path.iterdir())) == 2


def test_a_journal_that_cannot_be_moved_aside_is_one_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "journal.sqlite"
    path.write_bytes(b"garbage")

    def refuse(*_a):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(RecipeError, match="cannot be moved aside"):
        open_journal(path)


def test_writes_held_while_another_process_holds_the_lock_then_recorded(tmp_path, monkeypatch):
    """Another process keeps the write lock past the bounded wait: writes are held (said once), the live
    status still shows them, and they are recorded in order once the lock is free."""
    monkeypatch.setattr(J, "LOCK_WAIT_S", 0.3)
    path = healthy(tmp_path / "journal.sqlite")
    said: list[str] = []
    now = [0.0]
    j = Journal(path, echo=said.append, monotonic=lambda: now[0])
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    try:
        j.put(state="lock-1")
        j.event("a", "first")
        j.put(state="lock-2")
        assert j.held and j.held_reason == "another process holds the journal's write lock"
        assert j.get_all()["state"] == "lock-2", "the live status shows the held value"
        assert sum("journal_held" in s for s in said) == 1, said
        assert not j.flush(), "within the retry interval: not tried, no stall"
    finally:
        other.close()
    now[0] += J.HOLD_RETRY_S
    j.event("b", "second")
    assert not j.held
    kinds = [e["kind"] for e in j.events()]
    assert kinds[-3:] == ["journal_held", "a", "b"], kinds
    assert j.get_all()["state"] == "lock-2"
    j.close()


@pytest.fixture
def read_only_file(tmp_path):
    """A journal whose file is bind-mounted read-only (root cannot be kept out by permission bits);
    skipped where bind mounts are not allowed."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    path = healthy(tmp_path / "journal.sqlite")
    mounted = []

    def make_ro() -> None:
        for args in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,bind,ro", str(path)]):
            r = subprocess.run(args, check=False, capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"cannot bind-mount read-only here: {r.stderr.strip()}")
            mounted.append(path)

    def make_rw() -> None:
        while mounted:
            subprocess.run(["umount", "-l", str(mounted.pop())], check=False)  # -l: the reader has it open
    yield path, make_ro, make_rw
    make_rw()


def test_a_read_only_journal_holds_writes_and_records_them_once_writable(read_only_file):
    path, make_ro, make_rw = read_only_file
    make_ro()
    with pytest.raises(OSError):
        path.open("ab")
    said: list[str] = []
    now = [0.0]
    j = Journal(path, echo=said.append, monotonic=lambda: now[0])
    try:
        assert j.get_all()["state"] == "running", "still read"
        j.put(state="held")
        j.event("a", "held too")
        assert j.held and j.held_reason and "read-only" in j.held_reason
        assert j.get_all()["state"] == "held"
        make_rw()
        now[0] += J.HOLD_RETRY_S
        assert j.flush() and not j.held
        assert j.get_all()["state"] == "held" and j.events()[-1]["kind"] == "a"
    finally:
        j.close()
    r = Journal(path, readonly=True)
    try:
        assert json.dumps(r.get_all()["state"]) == '"held"'
    finally:
        r.close()


def test_the_end_of_run_summary_of_a_damaged_journal_is_one_line(write_recipe):
    """`run` prints a summary when it ends: a journal damaged while the supervisor had it open must not turn the
    end of a finished run into a traceback."""
    from orchestrator.config.recipe import load
    from orchestrator.ops.report import summary
    from orchestrator.store.rundir import state_dir

    r = load(write_recipe())
    path = J.journal_path(state_dir(r.run.output_dir))
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(4096))
    line = summary(r)
    assert line.startswith("summary: not available:") and "moves it aside" in line and "\n" not in line


@pytest.mark.parametrize("manifest_hash,drifted", [("h" * 64, False), ("f" * 64, True), (None, False)],
                         ids=["newest manifest: this recipe", "newest manifest: another recipe", "no manifest"])
def test_drift_is_still_seen_when_the_journal_is_damaged(tmp_path, manifest_hash, drifted):
    """The hash a damaged journal recorded is gone; the newest checkpoint manifest in the run dir says it."""
    from orchestrator.store.manifest import MANIFEST
    from orchestrator.store.rundir import place, state_dir

    out = tmp_path / "out"
    for step, h in ((10, "h" * 64), (20, manifest_hash)):
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        if h:
            (d / MANIFEST).write_text(json.dumps({"step": step, "recipe_hash": h, "files": []}))
    path = J.journal_path(state_dir(out))
    path.parent.mkdir()
    path.write_bytes(b"\x00garbage" * 100)
    p = place(out, "h" * 64, {}, "fresh")
    assert (p.output_dir != out) is drifted
    if drifted:
        assert p.output_dir.name == f"out-{'h' * 8}" and "unknown keys" in p.note


def test_rebuild_writes_back_what_the_disk_tells(tmp_path, write_recipe):
    """Local checkpoints of this hash (not another's, not one whose files changed after its manifest), published
    copies (one only published now, retention having deleted it locally; a merged copy) and the attempt logs."""
    from orchestrator.config.recipe import load
    from orchestrator.host.journal_health import JournalDamage
    from orchestrator.store.journal_rebuild import rebuild_journal
    from orchestrator.store.manifest import write_manifest
    from orchestrator.store.published import publish_dir
    from orchestrator.store.rundir import state_dir

    r = load(write_recipe(run={"persistent_dir": "persist"}))
    h, out = "h" * 64, Path(r.run.output_dir)
    for step, owner in ((10, h), (20, h), (30, "f" * 64), (40, h)):
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(b"w" * step)
        write_manifest(d, step, owner, loss=step / 100)
    (out / "checkpoint-40" / "weights.bin").write_bytes(b"changed after its manifest")
    pub = publish_dir(r.run.persistent_dir, r.run.name, h)
    for name in ("checkpoint-5", "checkpoint-20", "checkpoint-20-merged"):
        (pub / name).mkdir(parents=True)
        write_manifest(pub / name, int(name.split("-")[1]), h)
    logs = state_dir(out) / "attempts"
    logs.mkdir(parents=True)
    for n in (1, 2, 7):
        (logs / f"attempt-{n:04d}.log").write_text("...")
    j = Journal(tmp_path / "new.sqlite")
    try:
        damage = JournalDamage(tmp_path / "journal.sqlite", tmp_path / "journal.sqlite.damaged-x", "zero bytes")
        rebuilt = rebuild_journal(j, damage, r, h, out, state_dir(out))
        assert rebuilt.local == (10, 20) and rebuilt.published == (5, 20) and rebuilt.attempts_logged == 7
        rows = {c["step"]: c for c in j.checkpoints()}
        assert sorted(rows) == [5, 10, 20] and all(c["ok"] and c["recipe_hash"] == h for c in rows.values())
        assert rows[5]["synced_at"] and rows[20]["synced_at"] and not rows[10]["synced_at"]
        assert rows[10]["loss"] == 0.1 and rows[5]["path"] == str(pub / "checkpoint-5")
        assert j.get_all()["merged_synced"] == [20]
        (event,) = [e for e in j.events() if e["kind"] == "journal_replaced"]
        assert "zero bytes" in event["message"] and "goodput before now" in event["message"]
    finally:
        j.close()
