"""Published checkpoints: where a run's copies live under persistent_dir, the one listing of them, and
the lock that keeps two supervisors from publishing into the same place.

    <persistent_dir>/<run.name>-<hash8>/checkpoint-N[-merged]   this run's copies, each with its manifest
    <persistent_dir>/<run.name>-<hash8>/.orchestrator-publisher.lock   held by the supervisor publishing here
    <persistent_dir>/<run.name>-<hash8>/.orchestrator-sync.lock        held by one sync round at a time
    <persistent_dir>/checkpoint-N    the flat layout of earlier releases: restored from (and counted as
                                     published) when its manifest names this recipe; never written or pruned

A copy is a run's own only when it sits in the run's directory (or the flat layout) *and* its manifest
names the run's recipe hash: the directory name holds 8 hex digits of the hash, the manifest all of it.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.store.checkpoints import CKPT_RE, MERGED_RE, step_of
from orchestrator.store.manifest import read_manifest
from orchestrator.config.recipe import RecipeError

PUBLISHER_LOCK = ".orchestrator-publisher.lock"
# A `sync --once` takes the publisher lock shared for an instant to see whether a supervisor holds it;
# a supervisor starting in that instant retries this long before it calls the lock taken.
CHECKER_GRACE_S = 2.0


def publish_dir(persistent_dir: str | os.PathLike, run_name: str, recipe_hash: str) -> Path:
    """The directory a run publishes into: its name plus 8 hex digits of its recipe hash."""
    return Path(persistent_dir) / f"{run_name}-{recipe_hash[:8]}"


def owned(manifest: Mapping | None, recipe_hash: str | None) -> bool:
    """A published copy belongs to the run of `recipe_hash` (a copy without a manifest belongs to nobody)."""
    return manifest is not None and manifest.get("recipe_hash") == recipe_hash




def copies_in(d: str | os.PathLike[str]) -> dict[str, dict | None]:
    """Every checkpoint dir in one directory (any owner): name -> manifest. {} when d does not exist."""
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return {}
    return {e.name: read_manifest(e.path) for e in entries
            if (CKPT_RE.fullmatch(e.name) or MERGED_RE.fullmatch(e.name)) and e.is_dir()}


@dataclass(frozen=True)
class Copy:
    name: str               # checkpoint-N or checkpoint-N-merged
    step: int
    dir: Path               # the directory holding it: the run's publish dir, or persistent_dir (flat layout)
    manifest: dict
    flat: bool = False      # written by an earlier release into persistent_dir itself

    @property
    def path(self) -> Path:
        return self.dir / self.name

    @property
    def merged(self) -> bool:
        return MERGED_RE.fullmatch(self.name) is not None


def published(persistent_dir: str | os.PathLike, run_name: str, recipe_hash: str) -> list[Copy]:
    """This run's published copies, oldest step first: those in its publish dir whose manifest names its
    hash, then flat-layout copies of the same hash where the publish dir has none of that name.
    OSError when persistent_dir cannot be read."""
    own_dir, root = publish_dir(persistent_dir, run_name, recipe_hash), Path(persistent_dir)
    own = {n: Copy(n, step_of(n), own_dir, m) for n, m in copies_in(own_dir).items()
           if m is not None and owned(m, recipe_hash)}
    flat = {n: Copy(n, step_of(n), root, m, flat=True) for n, m in copies_in(root).items()
            if m is not None and owned(m, recipe_hash) and n not in own}
    return sorted([*own.values(), *flat.values()], key=lambda c: (c.step, c.merged, c.flat))


def published_steps(persistent_dir: str | os.PathLike, run_name: str, recipe_hash: str) -> set[int] | None:
    """Steps of this run's published checkpoints (merged copies aside); None when persistent_dir is unreadable."""
    try:
        return {c.step for c in published(persistent_dir, run_name, recipe_hash) if not c.merged}
    except OSError:
        return None


class PublishLock:
    """One publisher per publish dir: an flock held for the supervisor's lifetime, naming its holder.

    Two supervisors of one run name and recipe hash but different output dirs would otherwise publish
    different `checkpoint-N` into the same place. `orchestrator sync --once` does not hold it: it only
    checks (`check_for_sync`) that no supervisor of *another* output dir publishes here; with the
    supervisor of its own output dir alive it runs, its rounds and the publisher thread's serialised by the sync lock."""

    def __init__(self, persistent_dir: str | os.PathLike | None, run_name: str, recipe_hash: str,
                 output_dir: str | os.PathLike):
        self.dir = publish_dir(persistent_dir, run_name, recipe_hash) if persistent_dir else None
        self.run_name, self.hash, self.output_dir = run_name, recipe_hash, Path(output_dir).resolve()
        self.fd: int | None = None

    def _open(self) -> int:
        if self.dir is None:  # acquire() and check_for_sync() return before opening when publishing is off
            raise RuntimeError("PublishLock: no publish dir to lock (run.persistent_dir is not set)")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.dir / PUBLISHER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RecipeError(f"run.persistent_dir: cannot create {self.dir / PUBLISHER_LOCK} "
                              f"({e.strerror or e}): check the mount and permissions, or set "
                              f"run.persistent_dir = \"\" to run without publishing") from None

    def acquire(self) -> None:
        """Hold the lock until release(); RecipeError (exit 2) naming the holder when another supervisor has it."""
        if self.dir is None:
            return
        fd = self._open()
        deadline = time.monotonic() + CHECKER_GRACE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:  # a supervisor holds it (a check lasts an instant)
                    holder = _holder(fd)
                    os.close(fd)
                    raise RecipeError(self._taken(holder)) from None
                time.sleep(0.05)  # flock has no timeout, and a check's release sends no event
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "run": self.run_name, "recipe_hash": self.hash,
                                  "output_dir": str(self.output_dir)}).encode() + b"\n", 0)
        self.fd = fd

    def check_for_sync(self) -> None:
        """For `sync --once`: RecipeError when a supervisor of another output dir publishes here."""
        if self.dir is None:
            return
        try:
            fd = self._open()
        except RecipeError:
            return  # the sync round reports the unwritable persistent_dir itself
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # no supervisor holds it
                return
            except BlockingIOError:
                holder = _holder(fd)
            deadline = time.monotonic() + CHECKER_GRACE_S
            while not holder and time.monotonic() < deadline:  # locked, its holder not yet written down
                time.sleep(0.05)
                holder = _holder(fd)
            if holder.get("output_dir") != str(self.output_dir):
                raise RecipeError(self._taken(holder))
        finally:
            os.close(fd)

    def _taken(self, holder: dict) -> str:
        return (f"another supervisor (pid {holder.get('pid', '?')}) publishes run {holder.get('run', self.run_name)} "
                f"(recipe {str(holder.get('recipe_hash', '?'))[:8]}, output_dir {holder.get('output_dir', '?')}) "
                f"into {self.dir}; publishing from {self.output_dir} too would overwrite its checkpoints. "
                f"Stop that supervisor first, or give this run another run.name or run.persistent_dir")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
