"""The run's journal: SQLite in WAL mode, so `status`/`history` read it while the supervisor writes.

Tables: attempts (one row per launch), events (what happened, for people), checkpoints (what was
verified and synced), kv (current state, progress, recipe hash: the live status).

The journal is the run's memory, never its state: a write its place refuses (a full disk, a read-only file
or directory, another process holding the write lock past the bounded wait) is held in memory and replayed
once it can be written (`Journal.held`); a journal that is not readable as ours at all is moved aside by
journal_health.open_journal and a new one started.
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
from typing import Any

from orchestrator.types import Attempt, AttemptKind, CrashClass

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
# The journal's layout version (PRAGMA user_version; journals before it say 0). A journal of a higher one was
# written by a newer release: this one cannot read it as its own.
SCHEMA_VERSION = 2
# Columns added after a release, for journals written before them: (table, column, type).
ADDED_COLUMNS = (("checkpoints", "saved_at", "REAL"), ("attempts", "startup_s", "REAL"), ("attempts", "save_s", "REAL"),
                 ("attempts", "save_count", "INTEGER"), ("attempts", "node", "TEXT"), ("attempts", "system", "TEXT"),
                 ("attempts", "kind", "TEXT NOT NULL DEFAULT 'train'"), ("checkpoints", "standing", "TEXT"),
                 ("checkpoints", "reason", "TEXT"))


def _add_columns(db: sqlite3.Connection) -> None:
    for table, column, kind in ADDED_COLUMNS:
        if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def _reader(path: Path, never_write: bool = False) -> sqlite3.Connection:
    """A reader for status/history. A WAL reader needs the -shm file, which a strictly read-only
    connection cannot create after the writer closed; so open read-write but query-only, fall back to
    read-only where the file is not ours to write, and to immutable where the directory is not either
    (a read-only filesystem: nothing writes the journal there). `never_write`: read-only from the start, so
    closing it never folds the WAL into the file (a damaged journal is examined as it is)."""
    if not path.exists():
        raise FileNotFoundError(path)
    last: sqlite3.OperationalError | None = None
    for uri in (None, f"file:{path}?mode=ro", f"file:{path}?mode=ro&immutable=1")[1 if never_write else 0:]:
        db = sqlite3.connect(uri or path, uri=uri is not None, timeout=LOCK_WAIT_S, check_same_thread=False)
        try:
            if uri is None:
                db.execute("PRAGMA query_only = 1")
            db.execute("SELECT 1 FROM sqlite_master LIMIT 1")
            return db
        except sqlite3.OperationalError as e:
            db.close()
            if hold_reason(e) is None:
                raise
            last = e
    assert last is not None
    raise last


def disk_error(e: sqlite3.OperationalError) -> bool:
    """SQLITE_FULL ("database or disk is full") or an I/O error: the disk, not the journal, is at fault."""
    msg = str(e).lower()
    return "full" in msg or "disk i/o" in msg


# SQLite's messages for a write the journal's place refused, and what each means for a person. Any other
# error is the journal's content (journal_health.diagnose tells which).
DISK_FULL, DISK_IO, LOCKED = "the disk is full", "a disk I/O error", "another process holds the journal's write lock"
HOLD_REASONS = (("full", DISK_FULL), ("disk i/o", DISK_IO),
                ("readonly", "the journal is read-only"), ("read-only", "the journal is read-only"),
                ("unable to open", "the journal or its directory cannot be written"),
                ("locked", LOCKED), ("busy", LOCKED))
LOCK_WAIT_S = 10.0       # the bounded wait for another process's write lock
HOLD_RETRY_S = 5.0       # while held for a lock or a read-only journal: how often a write is tried again
RETRY_LOCK_WAIT_S = 0.2  # ... and how long that try waits for the lock (the loop must not stall)


def hold_reason(e: sqlite3.Error) -> str | None:
    """Why the journal's place refused a write, for a person; None when the error is not about its place."""
    if not isinstance(e, sqlite3.OperationalError):
        return None
    msg = str(e).lower()
    return next((why for key, why in HOLD_REASONS if key in msg), None)


def damaged_while_open(e: sqlite3.DatabaseError) -> str:
    """The hold reason for a journal that SQLite finds damaged after the supervisor opened it."""
    return f"the journal was damaged while open ({e}): the next start moves it aside"


def _open_writer(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=LOCK_WAIT_S, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            db.executescript(SCHEMA)  # IF NOT EXISTS: an older journal gains the tables added since
            _add_columns(db)          # ... and the columns
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.Error:
        db.close()
        raise
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
    def __init__(self, path: Path, readonly: bool = False, echo=None, clock=time.time, monotonic=time.monotonic,
                 never_write: bool = False):
        """Open the journal at `path`: a reader (`readonly`, for status/history; `never_write`: one that never
        touches the file, for examining a damaged one), else the supervisor's writer,
        created with its schema when missing. A writer whose place refuses writes (read-only, locked) opens
        as a reader and holds its writes until they can be made; sqlite3.DatabaseError when the file is not
        a journal (journal_health.open_journal moves such a one aside)."""
        self.path, self.clock, self.monotonic, self.readonly = path, clock, monotonic, readonly
        self.echo = echo  # called with each event line (the supervisor's console narration)
        self.held: list[tuple[str, Any, bool]] = []  # writes the journal's place refused, in order
        self.held_reason: str | None = None   # why, while writes are held
        self.retry_at = float("-inf")         # monotonic: when a held journal is tried again
        self.reopen = False                   # the connection is a reader: a write needs a new writer first
        if readonly:
            self.db = _reader(path, never_write)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                if not path.exists():
                    _create(path)
                self.db = _open_writer(path)
            except sqlite3.OperationalError as e:
                why = hold_reason(e)
                if why is None:
                    raise
                self.db, self.reopen = _reader(path), True
                self._hold(why)
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        """Record what is held (one more bounded wait for a lock), then close; says what could not be recorded."""
        if self.held and not self.reopen:
            self.db.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_S * 1000)}")
        if not self.flush(force=True) and self.echo:
            self.echo(f"journal: {self.path}: {self.held_reason}: {len(self.held)} held journal write(s) "
                      "could not be recorded before exit")
        self.db.close()

    def _write(self, sql: str, params, many: bool = False) -> None:
        """A write that its place cannot lose: refused ones (a full disk, a read-only or locked journal) are
        held in memory, in order, and replayed by a later write or flush() once they can be made. The
        supervisor must outlive all of these."""
        self.held.append((sql, params, many))
        self.flush()

    def _hold(self, why: str) -> None:
        """Writes are refused for `why`: said once per episode (on the console, and in the journal once it
        takes writes again); a lock or a read-only journal is tried again only every HOLD_RETRY_S."""
        if why not in (DISK_FULL, DISK_IO):
            self.retry_at = self.monotonic() + HOLD_RETRY_S
            self.db.execute(f"PRAGMA busy_timeout = {int(RETRY_LOCK_WAIT_S * 1000)}")
        if why not in (DISK_FULL, DISK_IO, LOCKED):  # read-only or damaged: only a new connection writes
            self.reopen = True
        if self.held_reason is None:
            self.held_reason = why
            self.event("journal_held", f"{self.path}: {why}: journal writes are held in memory until it can be "
                       "written (the run goes on)", reason=why)

    def flush(self, force: bool = False) -> bool:
        """Replay held writes; False while the journal's place still refuses them. `force`: try now, even
        within the retry interval of a lock or a read-only journal (at shutdown)."""
        if not self.held:
            return True
        if not force and self.monotonic() < self.retry_at:
            return False
        if self.reopen:
            try:
                db = _open_writer(self.path)
            except sqlite3.DatabaseError as e:
                self._hold(hold_reason(e) or damaged_while_open(e))
                return False
            db.row_factory = sqlite3.Row
            self.db.close()
            self.db, self.reopen = db, False
        while self.held:
            sql, params, many = self.held[0]
            try:
                (self.db.executemany if many else self.db.execute)(sql, params)
            except sqlite3.DatabaseError as e:
                why = hold_reason(e) or (None if isinstance(e, sqlite3.OperationalError) else damaged_while_open(e))
                if why is None:  # a statement of ours SQLite rejects: a bug, not the journal's place
                    raise
                self._hold(why)
                return False
            self.held.pop(0)
        if self.held_reason is not None:
            self.db.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_S * 1000)}")
            was, self.held_reason, self.retry_at = self.held_reason, None, float("-inf")
            if self.echo:
                self.echo(f"journal: {self.path} takes writes again ({was} no more): the held writes are recorded")
        return True

    def _rows(self, sql: str, params=()) -> list[sqlite3.Row]:
        """A query's rows. The supervisor's journal damaged while open (overwritten, truncated) reads as empty,
        its writes held: the run goes on, and its next start moves the file aside. Readers raise (diagnose)."""
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as e:
            why = hold_reason(e) or (None if isinstance(e, sqlite3.OperationalError) else damaged_while_open(e))
            if self.readonly or why is None:
                raise
            self._hold(why)
            return []

    # --- attempts
    def record_attempt(self, a: Attempt) -> None:
        row = asdict(a)
        row["evidence"] = json.dumps(list(a.evidence))
        row["cls"] = a.cls.value if a.cls else None
        row["kind"] = str(a.kind)
        row["system"] = json.dumps(a.system, default=str) if a.system is not None else None
        cols = ", ".join(row)
        self._write(f"INSERT OR REPLACE INTO attempts ({cols}) VALUES ({', '.join('?' * len(row))})",
                    list(row.values()))

    def attempts(self) -> list[Attempt]:
        out = []
        for r in self._rows("SELECT * FROM attempts ORDER BY n"):
            # a reader: older columns only (`in r` would test a Row's values, not its keys)
            d = {f.name: r[f.name] for f in fields(Attempt) if f.name in r.keys()}  # noqa: SIM118
            d["evidence"] = tuple(json.loads(d["evidence"] or "[]"))
            d["cls"] = CrashClass(d["cls"]) if d["cls"] else None
            d["system"] = json.loads(d["system"]) if d["system"] else None
            d["kind"] = AttemptKind(d.get("kind") or AttemptKind.TRAIN)
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
        rows = self._rows("SELECT at, kind, message, data FROM events ORDER BY id DESC LIMIT ?", (limit,))
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
                    " synced_at, saved_at, standing, reason) VALUES (?, ?, ?, ?, ?, ?, ?,"
                    " (SELECT synced_at FROM checkpoints WHERE step = ?), ?,"
                    " (SELECT standing FROM checkpoints WHERE step = ?), (SELECT reason FROM checkpoints WHERE step = ?))",
                    (step, path, int(ok), json.dumps(list(problems)), loss, recipe_hash, self.clock(), step,
                     saved_at, step, step))

    def record_standing(self, step: int, path: str, standing: str, reason: str | None = None,
                        saved_at: float | None = None) -> None:
        """Records a checkpoint's standing (store/standing.py is its one owner); a step not recorded yet gets a
        row (not ok until verified). `saved_at`: the newest file time of the save the standing is about."""
        self._write("INSERT OR IGNORE INTO checkpoints (step, path, ok) VALUES (?, ?, 0)", (step, path))
        self._write("UPDATE checkpoints SET standing = ?, reason = ?, path = ?,"
                    " saved_at = COALESCE(?, saved_at) WHERE step = ?", (standing, reason, path, saved_at, step))

    def mark_synced(self, step: int) -> None:
        self._write("UPDATE checkpoints SET synced_at = ? WHERE step = ?", (self.clock(), step))

    def checkpoints(self) -> list[dict]:
        return [dict(r) | {"problems": json.loads(r["problems"])}
                for r in self._rows("SELECT * FROM checkpoints ORDER BY step")]

    # --- time between attempts (cleanup, verify, wait, backoff), for goodput
    def span(self, start: float, end: float, kind: str) -> None:
        self._write("INSERT INTO spans (start, end, kind) VALUES (?, ?, ?)", (start, end, kind))

    def spans(self) -> list[tuple[float, float, str]]:
        return [tuple(r) for r in self._rows("SELECT start, end, kind FROM spans ORDER BY start")]

    # --- live status
    def put(self, **values) -> None:
        self._write("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)",
                    [(k, json.dumps(v, default=str)) for k, v in values.items()], many=True)

    def get_all(self) -> dict:
        """The live status: the kv table, with the values of held writes on top (what the supervisor last put)."""
        kv = {r["key"]: json.loads(r["value"]) for r in self._rows("SELECT key, value FROM kv")}
        for sql, params, many in self.held:
            if many and sql.startswith("INSERT OR REPLACE INTO kv"):
                kv.update((k, json.loads(v)) for k, v in params)
        return kv
