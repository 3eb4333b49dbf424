"""The run's journal: SQLite in WAL mode, so `status`/`history` read it while the supervisor writes.

Tables: attempts (one row per launch), events (what happened, for people), checkpoints (what was
verified and synced), kv (current state, progress, recipe hash: the live status).
"""
from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, fields
from pathlib import Path

from orchestrator.types import Attempt, CrashClass

SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
    n INTEGER PRIMARY KEY, started_at REAL NOT NULL, ended_at REAL, pid INTEGER, pid_start_time REAL,
    port INTEGER, exit_code INTEGER, signal INTEGER, cls TEXT, evidence TEXT NOT NULL DEFAULT '[]',
    start_step INTEGER, end_step INTEGER, resumed_from TEXT, log_path TEXT,
    first_step_at REAL, last_step_at REAL, hang_detected_at REAL);
CREATE TABLE IF NOT EXISTS spans (start REAL NOT NULL, end REAL NOT NULL, kind TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER PRIMARY KEY, path TEXT NOT NULL, ok INTEGER NOT NULL, problems TEXT NOT NULL DEFAULT '[]',
    loss REAL, recipe_hash TEXT, verified_at REAL, synced_at REAL, saved_at REAL);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# Columns added after a release, for journals written before them: (table, column, type).
ADDED_COLUMNS = (("checkpoints", "saved_at", "REAL"), ("attempts", "startup_s", "REAL"), ("attempts", "save_s", "REAL"),
                 ("attempts", "save_count", "INTEGER"), ("attempts", "node", "TEXT"), ("attempts", "system", "TEXT"),
                 ("attempts", "kind", "TEXT NOT NULL DEFAULT 'train'"))


def _add_columns(db: sqlite3.Connection) -> None:
    for table, column, kind in ADDED_COLUMNS:
        if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def _reader(path: Path) -> sqlite3.Connection:
    """A reader for status/history. A WAL reader needs the -shm file, which a strictly read-only
    connection cannot create after the writer closed; so open read-write but query-only, and fall
    back to read-only where the directory is not ours to write."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        db = sqlite3.connect(path, timeout=10, check_same_thread=False)
        db.execute("PRAGMA query_only = 1")
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1")
        return db
    except sqlite3.OperationalError:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, check_same_thread=False)


def disk_error(e: sqlite3.OperationalError) -> bool:
    """SQLITE_FULL ("database or disk is full") or an I/O error: the disk, not the journal, is at fault."""
    msg = str(e).lower()
    return "full" in msg or "disk i/o" in msg


def _open_writer(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=10, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(SCHEMA)  # IF NOT EXISTS: an older journal gains the tables added since
    _add_columns(db)          # ... and the columns
    return db


def _create(path: Path) -> None:
    """A new journal appears with its schema: built under a temporary name, then linked into place
    (a `status` that finds the file finds the tables; link, unlike rename, never replaces a journal
    another process created meanwhile)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".creating")
    os.close(fd)
    try:
        _open_writer(Path(tmp)).close()  # the last connection closing folds the WAL into the file
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this filesystem: rename is as atomic, only not exclusive
            if not path.exists():
                os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def journal_path(state_dir: Path) -> Path:
    return state_dir / "journal.sqlite"


class Journal:
    def __init__(self, path: Path, readonly: bool = False, echo=None, clock=time.time):
        self.path, self.clock = path, clock
        self.echo = echo  # called with each event line (the supervisor's console narration)
        if readonly:
            self.db = _reader(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                _create(path)
            self.db = _open_writer(path)
        self.db.row_factory = sqlite3.Row
        self.held: list[tuple[str, object, bool]] = []  # writes a full disk refused, in order

    def close(self) -> None:
        self.flush()
        self.db.close()

    def _write(self, sql: str, params, many: bool = False) -> None:
        """A write that a full disk cannot lose: refused ones are held in memory, in order, and replayed by
        the next write or flush() once space returns. The supervisor must outlive a full disk."""
        self.held.append((sql, params, many))
        self.flush()

    def flush(self) -> bool:
        """Replay held writes; False while the disk still refuses them."""
        while self.held:
            sql, params, many = self.held[0]
            try:
                (self.db.executemany if many else self.db.execute)(sql, params)
            except sqlite3.OperationalError as e:
                if not disk_error(e):
                    raise
                return False
            self.held.pop(0)
        return True

    # --- attempts
    def record_attempt(self, a: Attempt) -> None:
        row = asdict(a)
        row["evidence"] = json.dumps(list(a.evidence))
        row["cls"] = a.cls.value if a.cls else None
        row["system"] = json.dumps(a.system, default=str) if a.system is not None else None
        cols = ", ".join(row)
        self._write(f"INSERT OR REPLACE INTO attempts ({cols}) VALUES ({', '.join('?' * len(row))})",
                    list(row.values()))

    def attempts(self) -> list[Attempt]:
        out = []
        for r in self.db.execute("SELECT * FROM attempts ORDER BY n"):
            d = {f.name: r[f.name] for f in fields(Attempt) if f.name in r.keys()}  # a reader: older columns only
            d["evidence"] = tuple(json.loads(d["evidence"] or "[]"))
            d["cls"] = CrashClass(d["cls"]) if d["cls"] else None
            d["system"] = json.loads(d["system"]) if d["system"] else None
            out.append(Attempt(**d))
        return out

    def last_attempt(self) -> Attempt | None:
        rows = self.attempts()
        return rows[-1] if rows else None

    # --- events
    def event(self, kind: str, message: str, **data) -> None:
        now = self.clock()
        self._write("INSERT INTO events (at, kind, message, data) VALUES (?, ?, ?, ?)",
                    (now, kind, message, json.dumps(data, default=str)))
        if self.echo:
            self.echo(f"{time.strftime('%H:%M:%S', time.localtime(now))} {kind}: {message}")

    def events(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT at, kind, message, data FROM events ORDER BY id DESC LIMIT ?", (limit,))
        return [{"at": r["at"], "kind": r["kind"], "message": r["message"], "data": json.loads(r["data"])}
                for r in rows][::-1]

    def events_of(self, kinds: Iterable[str]) -> list[dict]:
        """Every event of these kinds, oldest first (the run's health events for history and the report)."""
        kinds = list(kinds)
        rows = self.db.execute(f"SELECT at, kind, message, data FROM events WHERE kind IN ({', '.join('?' * len(kinds))})"
                               " ORDER BY id", kinds)
        return [{"at": r["at"], "kind": r["kind"], "message": r["message"], "data": json.loads(r["data"])} for r in rows]

    # --- checkpoints
    def record_checkpoint(self, step: int, path: str, ok: bool, problems: tuple[str, ...] = (),
                          loss: float | None = None, recipe_hash: str | None = None,
                          saved_at: float | None = None) -> None:
        """`saved_at`: when the trainer finished writing it (goodput charges the work after it when it is lost)."""
        self._write("INSERT OR REPLACE INTO checkpoints (step, path, ok, problems, loss, recipe_hash, verified_at,"
                    " synced_at, saved_at) VALUES (?, ?, ?, ?, ?, ?, ?,"
                    " (SELECT synced_at FROM checkpoints WHERE step = ?), ?)",
                    (step, path, int(ok), json.dumps(list(problems)), loss, recipe_hash, self.clock(), step,
                     saved_at))

    def mark_synced(self, step: int) -> None:
        self._write("UPDATE checkpoints SET synced_at = ? WHERE step = ?", (self.clock(), step))

    def checkpoints(self) -> list[dict]:
        return [dict(r) | {"problems": json.loads(r["problems"])}
                for r in self.db.execute("SELECT * FROM checkpoints ORDER BY step")]

    # --- time between attempts (cleanup, verify, wait, backoff), for goodput
    def span(self, start: float, end: float, kind: str) -> None:
        self._write("INSERT INTO spans (start, end, kind) VALUES (?, ?, ?)", (start, end, kind))

    def spans(self) -> list[tuple[float, float, str]]:
        return [tuple(r) for r in self.db.execute("SELECT start, end, kind FROM spans ORDER BY start")]

    # --- live status
    def put(self, **values) -> None:
        self._write("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)",
                    [(k, json.dumps(v, default=str)) for k, v in values.items()], many=True)

    def get_all(self) -> dict:
        return {r["key"]: json.loads(r["value"]) for r in self.db.execute("SELECT key, value FROM kv")}
