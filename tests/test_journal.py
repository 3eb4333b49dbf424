"""The journal on real SQLite files: a reader never meets a journal without its tables."""
from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

from orchestrator.host import journal as J
from orchestrator.host.journal import Journal
from orchestrator.types import Attempt


def read_everything(path) -> None:
    """What `status` and `history` read."""
    r = Journal(path, readonly=True)
    try:
        r.get_all(), r.attempts(), r.events(), r.checkpoints(), r.spans()
    finally:
        r.close()


def test_a_reader_opened_at_any_moment_of_creation_finds_the_schema(tmp_path, monkeypatch):
    """Every statement the writer runs is a moment a `status` could open the file: probe each one."""
    path = tmp_path / "state" / "journal.sqlite"
    real_connect, seen, probing = sqlite3.connect, [], [False]

    def probe(_statement: str) -> None:
        if probing[0] or not path.exists():
            return
        probing[0] = True
        try:
            read_everything(path)
            seen.append("ok")
        except sqlite3.Error as e:
            seen.append(f"{type(e).__name__}: {e}")
        finally:
            probing[0] = False

    def traced_connect(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        db.set_trace_callback(probe)
        return db

    monkeypatch.setattr(J.sqlite3, "connect", traced_connect)
    Journal(path).close()
    assert seen and set(seen) == {"ok"}, seen


def test_a_reader_polling_for_the_file_finds_the_schema(tmp_path):
    """The same from another thread: open the reader the moment the file appears."""
    paths = [tmp_path / f"run{i}" / "journal.sqlite" for i in range(20)]
    results: list[str] = []
    ready = threading.Event()

    def watch() -> None:
        ready.set()
        deadline = time.monotonic() + 30
        for path in paths:
            while not os.path.exists(path):  # spin: a reader as early as one can be
                if time.monotonic() > deadline:
                    return
            try:
                read_everything(path)
                results.append("ok")
            except sqlite3.Error as e:
                results.append(str(e))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    ready.wait()
    for path in paths:
        Journal(path).close()
    t.join(timeout=30)
    assert not t.is_alive() and results == ["ok"] * len(paths), results


def test_creation_leaves_only_the_journal(tmp_path):
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.sqlite"]


def test_an_existing_journal_is_kept(tmp_path):
    path = tmp_path / "journal.sqlite"
    j = Journal(path)
    j.record_attempt(Attempt(1, 10.0))
    j.put(state="running")
    j.close()
    again = Journal(path)
    try:
        assert [a.n for a in again.attempts()] == [1] and again.get_all() == {"state": "running"}
    finally:
        again.close()


def test_a_journal_created_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """Link, not rename: if another process put a journal in place first, its rows survive."""
    path = tmp_path / "journal.sqlite"
    real_open = J._open_writer

    def racing_open(p):
        if p != path and not path.exists():  # the temporary journal: another creator wins the race now
            other = real_open(path)
            other.execute("INSERT INTO kv (key, value) VALUES ('winner', '\"other\"')")
            other.close()
        return real_open(p)

    monkeypatch.setattr(J, "_open_writer", racing_open)
    j = Journal(path)
    try:
        assert j.get_all() == {"winner": "other"}
    finally:
        j.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.sqlite"]


def test_reader_of_a_missing_journal(tmp_path):
    with pytest.raises(FileNotFoundError):
        Journal(tmp_path / "journal.sqlite", readonly=True)
    assert not (tmp_path / "journal.sqlite").exists()
