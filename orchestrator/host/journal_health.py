"""Whether a file is readable as the run's journal, and what `run` does when it is not.

The journal is the run's memory, never its state (that is the checkpoints with their manifests): a journal
that is not a database, truncated, emptied, holds other tables or comes from a newer release must never stop
a run. `open_journal` moves such a file aside (renamed with a timestamp beside it, never deleted), starts a
new one and says what was wrong; store/journal_rebuild.py then rebuilds what the disk still tells.
`status`, `history` and `report` print `damaged_line` and exit 2 instead.
"""
from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.recipe import RecipeError
from orchestrator.host.journal import (
    ADDED_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    Journal,
    hold_reason,
)

DAMAGED = ".damaged-"     # <journal>.damaged-<UTC time>: where a damaged journal is moved
SIDE_FILES = ("-wal", "-shm")  # SQLite's files beside a journal, moved with it (a -wal left behind would be
                               # read into the new journal)


@dataclass(frozen=True)
class JournalDamage:
    """A journal `run` could not use: where it was, where it is now, and what was wrong with it."""
    path: Path
    moved_to: Path
    problem: str


def _journal_columns() -> dict[str, set[str]]:
    """Each table of the journal and the columns every release wrote (later columns a writer adds)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        return {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")}
                for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    finally:
        db.close()


def _layout_problem(db: sqlite3.Connection) -> str | None:
    """What in the file's tables is not the journal's: a newer release's version, other tables, missing columns."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        return (f"written by a newer release of orchestrator (journal version {version}; this release reads up "
                f"to {SCHEMA_VERSION})")
    check = [r[0] for r in db.execute("PRAGMA quick_check(3)")]
    if check != ["ok"]:
        return f"damaged pages ({'; '.join(check)})"
    kinds = dict(db.execute("SELECT name, type FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall())
    expected = _journal_columns()
    if not kinds:
        return "an empty database (no tables)"
    if not set(kinds) & set(expected):
        return f"not an orchestrator journal (it holds {', '.join(sorted(kinds))})"
    if missing_tables := sorted(set(expected) - set(kinds)):  # every release wrote all of them
        return f"malformed: no table {', '.join(missing_tables)}"
    for table, columns in expected.items():
        if kinds[table] != "table":
            return f"malformed: {table} is a {kinds[table]}, not a table"
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        added = {c for t, c, _ in ADDED_COLUMNS if t == table}
        if missing := sorted(columns - have - added):
            return f"malformed: table {table} lacks column(s) {', '.join(missing)}"
    return None


def diagnose(path: Path) -> str | None:
    """Say what makes the file at `path` unreadable as the run's journal, reading it only; None when it reads
    (or when only its place refuses access: a lock, a read-only directory are no damage)."""
    try:
        if path.stat().st_size == 0:
            return "zero bytes (emptied: no tables, no rows)"
    except FileNotFoundError:
        return None
    try:
        j = Journal(path, readonly=True, never_write=True)
    except sqlite3.DatabaseError as e:
        return None if hold_reason(e) else str(e)
    try:
        problem = _layout_problem(j.db)
        if problem is None:  # every row the supervisor and `status` read, decoded as they decode it
            j.get_all(), j.attempts(), j.checkpoints(), j.spans(), j.events(limit=-1)
    except sqlite3.DatabaseError as e:
        problem = None if hold_reason(e) else str(e)
    except (ValueError, TypeError, KeyError) as e:
        problem = f"unreadable rows ({type(e).__name__}: {e})"
    finally:
        j.db.close()
    return problem


def damaged_line(path: Path, problem: str) -> str:
    """The one line `status`, `history` and `report` print for a damaged journal: the file, what is wrong,
    what `run` will do."""
    return (f"{path}: {problem}: not readable as this run's journal. `orchestrator run` will move it aside "
            f"({path.name}{DAMAGED}<time>, kept), start a new journal rebuilt from the checkpoints on disk and "
            f"resume from the newest verified one")


def move_aside(path: Path, now: float) -> Path:
    """Rename the journal (and its -wal, -shm) to <name>.damaged-<UTC time> beside it; returns the new path.
    RecipeError (exit 2) when it cannot be renamed: a new journal cannot take its place then."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target, k = path.with_name(f"{path.name}{DAMAGED}{stamp}"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}{DAMAGED}{stamp}.{k}")
    try:
        for side in SIDE_FILES[::-1]:  # the side files first: a journal never sits beside another's WAL
            if os.path.exists(f"{path}{side}"):
                os.rename(f"{path}{side}", f"{target}{side}")
        os.rename(path, target)
    except OSError as e:
        raise RecipeError(f"{path} is damaged and cannot be moved aside ({e.strerror or e}); move it away by hand "
                          f"and run again: a new journal is rebuilt from the checkpoints on disk") from None
    return target


def open_journal(path: Path, echo=None, clock=time.time) -> tuple[Journal, JournalDamage | None]:
    """Open the run's journal for the supervisor. One that is not readable as the journal is moved aside and a
    new one started: returns the new journal and what was wrong (None when the journal was fine)."""
    problem = diagnose(path)
    if problem is None:
        try:
            return Journal(path, echo=echo, clock=clock), None
        except sqlite3.DatabaseError as e:
            if hold_reason(e):  # not even a reader opens: its place, not its content (never moved for that)
                raise RecipeError(f"{path}: cannot be opened ({e}); check the permissions and the mount of "
                                  f"{path.parent}") from None
            problem = str(e)  # damage only the writer finds
    moved = move_aside(path, clock())
    return Journal(path, echo=echo, clock=clock), JournalDamage(path, moved, problem)
