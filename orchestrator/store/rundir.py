"""The run directory: where a run's trainer output, journal, attempt logs and lock live, and which
directory a recipe maps to when its hash drifted.

    <output_dir>/                      the trainer's --output_dir (checkpoints, logging.jsonl)
    <output_dir>/.orchestrator/        journal.sqlite, lock, attempts/attempt-0001.log, stacks
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.recipe import RecipeError, changed_keys
from orchestrator.domain.checkpoint_names import CKPT_RE, step_of
from orchestrator.host.journal import Journal, journal_path
from orchestrator.host.journal_health import diagnose
from orchestrator.store.manifest import read_manifest

STATE_DIR = ".orchestrator"


def state_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / STATE_DIR


def run_id(output_dir: str | Path) -> str:
    """Marker value in the environment of every process of this run (finds orphans)."""
    return hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]


def recorded_hash(output_dir: Path) -> tuple[str | None, dict | None]:
    """The recipe hash (and semantic view) the run in output_dir was started with: from its journal, or, when
    the journal is damaged, the hash named by the newest checkpoint manifest there (the view unknown)."""
    path = journal_path(state_dir(output_dir))
    if not path.exists():
        return None, None
    if diagnose(path) is not None:
        return newest_manifest_hash(output_dir), None
    j = Journal(path, readonly=True)
    try:
        kv = j.get_all()
    finally:
        j.close()
    return kv.get("recipe_hash"), kv.get("semantic_view")


def newest_manifest_hash(output_dir: Path) -> str | None:
    """The recipe hash in the manifest of the newest checkpoint in output_dir that has one."""
    try:
        dirs = sorted((d for d in output_dir.iterdir() if CKPT_RE.fullmatch(d.name)), key=lambda d: step_of(d.name))
    except OSError:
        return None
    for d in reversed(dirs):
        m = read_manifest(d)
        if m is not None and isinstance(m.get("recipe_hash"), str):
            return m["recipe_hash"]
    return None


@dataclass(frozen=True)
class Placement:
    output_dir: Path
    drifted_keys: tuple[str, ...] = ()   # non-empty when the recipe changed since the run started
    note: str = ""


def place(output_dir: str | Path, new_hash: str, new_view: dict, on_drift: str) -> Placement:
    """Where this recipe's run lives. Drift (the run directory holds another recipe hash):
    fresh  -> <output_dir>-<hash[:8]>, every old checkpoint kept;
    refuse -> RecipeError naming the keys (the caller exits 3);
    resume -> keep going in output_dir (explicit operator override)."""
    base = Path(output_dir)
    old_hash, old_view = recorded_hash(base)
    if old_hash is None or old_hash == new_hash:
        return Placement(base)
    keys = tuple(changed_keys(old_view or {}, new_view))
    what = ", ".join(keys) or "unknown keys"
    if on_drift == "refuse":
        raise DriftRefused(f"recipe changed since this run started ({what}); run.on_drift = \"refuse\"."
                           f" Restore the old values, or set run.on_drift = \"fresh\" or \"resume\"")
    if on_drift == "resume":
        return Placement(base, keys, f"recipe drift ({what}) ignored: run.on_drift = \"resume\"")
    fresh = base.with_name(f"{base.name}-{new_hash[:8]}")
    return Placement(fresh, keys, f"recipe drift ({what}): starting a fresh run in {fresh}; {base} is kept")


class DriftRefused(RecipeError):
    pass


class RunLock:
    """One supervisor per run directory: an flock held for the supervisor's lifetime."""

    def __init__(self, output_dir: Path):
        self.path = state_dir(output_dir) / "lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        """Hold the lock until release(); RecipeError (exit 2) when another supervisor holds it, or when the
        lock cannot be opened at all (without it two supervisors could run one directory)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RecipeError(f"{self.path}: cannot open the run lock ({e.strerror or e}); check that "
                              f"{self.path.parent} is a writable directory and {self.path.name} a plain file "
                              f"(delete it if not: it only holds the supervisor's pid)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RecipeError(f"{self.path.parent.parent}: another supervisor (pid {holder}) is running this run;"
                              " stop it first (one supervisor per run directory)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
