"""Publish the newest verified checkpoint to persistent storage, and restore one (sync_thread.py repeats
the rounds).

`persistent` here is the directory one run publishes into (published.publish_dir: its name and recipe hash
under run.persistent_dir). A copy there whose manifest names another recipe hash is never overwritten,
pruned or restored: it is reported and left alone.

Publication is atomic: copy into `<persistent>/.partial-<name>/`, fsync, verify the copy against the manifest
(sizes + sha256; copytree hashes and flushes each file as it is written: large files by a few threads
beside rsync, the rest behind rsync's writes, so both cost little beyond the copy), then rename to `<persistent>/<name>`. Only `.partial-*` names are ever incomplete. A staging
dir left by a killed sync is reused (rsync skips files already there), so a retry resumes file by file.
"""
from __future__ import annotations

import fcntl
import fnmatch
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.store import checkpoints as ck
from orchestrator.store import manifest as mf
from orchestrator.store.copytree import copy_tree, same_file
from orchestrator.store.published import copies_in, owned
from orchestrator.types import GIB

log = logging.getLogger(__name__)
LOCK = ".orchestrator-sync.lock"
PARTIAL = ".partial-"
MCORE_SHARDS = "iter_*/*.distcp"      # optimizer + mcore adapter shards; common.pt stays (resume reads it)
CANCELLED = "cancelled"
REFUSED = "refused: "                 # the gate refused a copy made meanwhile (a finding during the copy)


@dataclass(frozen=True)
class SyncResult:
    copied: tuple[str, ...] = ()       # names published this round (checkpoint-N, checkpoint-N-merged)
    bytes_copied: int = 0
    skipped: tuple[str, ...] = ()      # why a checkpoint was not published (informational)
    problems: tuple[str, ...] = ()     # needs an operator: corrupt checkpoints, full/unwritable storage, copy errors
    deleted: tuple[str, ...] = ()
    newest_local: int | None = None     # newest verified local step
    newest_published: int | None = None
    lag_steps: int | None = None
    lag_s: float | None = None         # age of the oldest local checkpoint newer than the newest published one
    synced: bool = False               # the round ran and everything planned is published
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


class SyncError(Exception):
    """A restore that cannot be done; the message says what to do."""


# ---------------------------------------------------------------- pure decisions

def retain(steps: Mapping[int, float | None], keep: int) -> set[int]:
    """Steps to keep: the newest `keep` (at least 1, so the newest copy is never dropped) plus the best loss."""
    kept = set(sorted(steps, reverse=True)[:max(1, keep)])
    losses = {s: l for s, l in steps.items() if isinstance(l, (int, float)) and math.isfinite(l)}
    if losses:
        kept.add(min(losses, key=lambda s: (losses[s], -s)))
    return kept


def filter_manifest(manifest: Mapping, excludes: tuple[str, ...]) -> dict:
    files = [f for f in manifest["files"] if not any(fnmatch.fnmatch(f["path"], p) for p in excludes)]
    out = dict(manifest, files=files)
    if len(files) != len(manifest["files"]):
        out["excluded"] = list(excludes)
    return out


def same_content(a: Mapping | None, b: Mapping | None) -> bool:
    """Same step and files (path, size, sha256); a missing or malformed manifest never matches."""
    if a is None or b is None:
        return False
    try:
        key = [(m["step"], [(f["path"], f["size"], f["sha256"]) for f in m["files"]]) for m in (a, b)]
    except (KeyError, TypeError):
        return False
    return key[0] == key[1]


def space_problem(persistent: Path, free: int, need: int) -> str:
    return (f"persistent_dir {persistent} has {free / GIB:.1f} GiB free, needs {need / GIB:.1f} GiB: "
            f"free space or lower retention")


def _copy(src: Path, dst: Path, manifest: Mapping, link_dest: Path | None, excludes: tuple[str, ...],
          lock_fd: int | None, bwlimit_kib: int | None, cancel: threading.Event | None) -> tuple[int, dict[str, str]]:
    return copy_tree(src, dst, [f["path"] for f in manifest["files"]], link_dest,
                     (*excludes, mf.MANIFEST, f".{mf.MANIFEST}.tmp-*"), lock_fd, bwlimit_kib, cancel)


def _check_copy(dst: Path, manifest: Mapping, known: Mapping[str, str]) -> list[str]:
    extra = sorted(set(mf.list_files(dst)) - {f["path"] for f in manifest["files"]})
    problems = [f"{dst.name}/{r}: not in the manifest" for r in extra[:3]]
    return problems + mf.manifest_matches(dst, manifest, known=known)


def _need_bytes(src: Path, manifest: Mapping, staging: Path, link_dest: Path | None) -> int:
    need = 0
    for f in manifest["files"]:
        st = (src / f["path"]).stat()
        if not (same_file(st, staging / f["path"]) or (link_dest and same_file(st, link_dest / f["path"]))):
            need += f["size"]
    return need


def _remove(path: Path) -> None:
    """Rename out of sight first, so a reader never sees a half-deleted checkpoint."""
    gone = path.with_name(f"{PARTIAL}deleting-{path.name}-{os.getpid()}")
    os.rename(path, gone)
    mf.fsync_dir(path.parent)
    shutil.rmtree(gone, ignore_errors=True)


def _publish(src: Path, persistent: Path, manifest: dict, link_dest: Path | None, opts: dict) -> tuple[int, str | None]:
    """Stage, verify and rename one checkpoint dir. Returns (bytes copied, problem or None)."""
    name = src.name
    staging, final = persistent / f"{PARTIAL}{name}", persistent / name
    try:
        need = _need_bytes(src, manifest, staging, link_dest) + opts["margin"]
        free = shutil.disk_usage(persistent).free
        if free < need:
            return 0, space_problem(persistent, free, need)
        n, digests = _copy(src, staging, manifest, link_dest, opts["excludes"], opts["lock_fd"], opts["bwlimit_kib"],
                           opts["cancel"])
    except OSError as e:
        if opts["cancel"] is not None and opts["cancel"].is_set():
            return 0, CANCELLED  # the staging dir stays: the next round resumes it
        if not src.exists() or "No space left" in str(e) or getattr(e, "errno", None) == 28:
            shutil.rmtree(staging, ignore_errors=True)  # nothing to resume, or the space is needed back
        gone = " (deleted locally during the copy: save_total_limit rotation?)" if not src.exists() else ""
        return 0, f"copying {name} to {persistent} failed{gone}: {e}"
    bad = _check_copy(staging, manifest, digests)
    if not bad and opts.get("refuse") is not None and (why := opts["refuse"]()):
        shutil.rmtree(staging, ignore_errors=True)  # set aside while it was being copied: never takes its name
        return n, REFUSED + why
    if bad:
        shutil.rmtree(staging, ignore_errors=True)
        if link_dest is not None:  # a quick-check false match against the previous copy: copy it all
            m, why = _publish(src, persistent, manifest, None, opts)
            return n + m, why
        return n, f"{name}: the copy in {persistent} does not match its manifest ({bad[0]}); it will be retried"
    mf.write_json_atomic(staging / mf.MANIFEST, manifest)
    if final.exists():  # republish after the local checkpoint changed (e.g. re-saved after a resume)
        _remove(final)
    os.rename(staging, final)
    mf.fsync_dir(persistent)
    return n, None


# ---------------------------------------------------------------- sync / restore

class InFlight:
    """The local checkpoint a publish round is copying. Local retention decides and renames under `lock`
    and never touches `path`; a round takes a path under the same lock only while it is still there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path: str | None = None

    def take(self, path: str) -> bool:
        with self.lock:
            self.path = path if os.path.isdir(path) else None
            return self.path is not None

    def release(self) -> None:
        with self.lock:
            self.path = None


def open_lock(persistent: Path, wait_s: float = 0.0) -> int:
    """The sync lock; BlockingIOError when another sync still holds it after wait_s."""
    persistent.mkdir(parents=True, exist_ok=True)
    fd = os.open(persistent / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
    except BaseException:
        os.close(fd)
        raise


def _published(persistent: Path) -> dict[str, dict | None]:
    os.listdir(persistent)  # OSError when missing or unreadable (copies_in calls a missing dir empty)
    return copies_in(persistent)





def foreign_problem(path: Path, manifest: Mapping | None, recipe_hash: str | None) -> str:
    whose = f"recipe {str(manifest.get('recipe_hash'))[:8]}" if manifest else "no manifest"
    return (f"{path} is not this run's copy ({whose}; this run is recipe {str(recipe_hash)[:8]}): "
            f"left as it is, never overwritten or pruned; move it away to publish this run's {path.name}")


def _losses(pub: Mapping[str, Mapping | None]) -> dict[int, float | None]:
    return {ck.step_of(n): (m or {}).get("loss") for n, m in pub.items() if ck.CKPT_RE.fullmatch(n)}


def _local_manifest(path: Path, step: int, recipe_hash: str | None, loss: float | None) -> dict:
    m = mf.read_manifest(path)
    if m is None or mf.manifest_stale(path, m):
        m = mf.build_manifest(path, step, recipe_hash, loss)
        mf.write_json_atomic(path / mf.MANIFEST, m)
    return m


def sync_once(output_dir: str | os.PathLike, persistent_dir: str | os.PathLike, backend: str,
              recipe_hash: str | None, keep: int = 3, include_mcore: bool = True, include_merged: bool = True,
              on_problem: Callable[[str], None] | None = None, *, bwlimit_kib: int | None = None,
              margin_bytes: int = 256 << 20, cancel: threading.Event | None = None,
              lock_wait_s: float = 0.0, in_flight: InFlight | None = None,
              gate: Callable[[int, str], str | None] | None = None) -> SyncResult:
    """Publish the newest verified local checkpoint (and its merged copy); prune old published ones.
    `in_flight`: shared with local retention, which never deletes the checkpoint being copied. `gate`: why a
    checkpoint (step, path) may not be published (its standing, store/standing.py), None when it may; asked
    before the copy and again before the copy takes its name."""
    t0, out, persistent = time.monotonic(), Path(output_dir), Path(persistent_dir)
    try:
        lock_fd = open_lock(persistent, lock_wait_s)
    except BlockingIOError:
        return _report(SyncResult(problems=(f"another sync holds {persistent / LOCK}; skipped this round",)),
                       on_problem, t0)
    except OSError as e:
        msg = f"persistent_dir {persistent} is not writable ({e.strerror or e}): check the mount, permissions and path"
        return _report(SyncResult(problems=(msg,)), on_problem, t0)
    opts: dict[str, Any] = {"excludes": () if include_mcore else (MCORE_SHARDS,), "lock_fd": lock_fd,
                            "bwlimit_kib": bwlimit_kib, "cancel": cancel, "margin": margin_bytes}
    deleted: list[str]
    copied, skipped, problems, deleted, nbytes = [], [], [], [], 0
    try:
        infos = ck.discover(out, backend)
        problems += [f"local {p}" for i in infos if i.complete and not i.ok for p in i.problems]
        skipped += [f"{Path(i.path).name}: still being written" for i in infos if not i.complete]
        local = {i.step: i for i in infos if i.ok}
        refused: dict[int, str] = {}
        if gate is not None:  # newest first, until it allows one: only the newest is published
            for s in sorted(local, reverse=True):
                if not (why := gate(s, local[s].path)):
                    break
                refused[s] = why
        local = {s: i for s, i in local.items() if s not in refused}
        skipped += [refused[s] for s in sorted(refused)]
        everything = _published(persistent)
        pub = {n: m for n, m in everything.items() if owned(m, recipe_hash)}
        foreign = {n: m for n, m in everything.items() if n not in pub}
        wanted = retain({**_losses(pub), **{s: i.loss for s, i in local.items()}}, keep)
        # Only the newest: an older unpublished one is superseded (a crash resumes from the local copies;
        # the published ones are for losing the node, where only the newest matters).
        newest = max(local, default=None)
        todo = [newest] if newest in wanted else []
        skipped += [f"checkpoint-{s}: superseded by checkpoint-{newest} (only the newest is published)"
                    for s in local if s != newest and f"checkpoint-{s}" not in pub]
        resumable = {f"{PARTIAL}checkpoint-{s}{sfx}" for s in todo for sfx in ("", "-merged")}
        for entry in persistent.iterdir():  # we hold the lock, so any other .partial-* is abandoned
            if entry.name.startswith(PARTIAL) and entry.name not in resumable:
                shutil.rmtree(entry, ignore_errors=True)
        for s in todo:
            if in_flight is not None and not in_flight.take(local[s].path):
                skipped.append(f"checkpoint-{s}: deleted locally before its copy started")
                continue
            dirs = [Path(local[s].path)]
            if include_merged and (merged_path := local[s].merged_path):
                mv = ck.verify(merged_path, backend=backend)
                dirs += [Path(mv.path)] if mv.ok else []
                problems += [f"local {p}" for p in mv.problems] if mv.complete else []
            opts["refuse"] = (lambda s=s: gate(s, local[s].path)) if gate is not None else None
            for src in dirs:
                try:
                    m = filter_manifest(_local_manifest(src, s, recipe_hash, local[s].loss), opts["excludes"])
                except OSError as e:  # e.g. rotated away while hashing
                    problems.append(f"cannot hash {src}: {e}")
                    continue
                if not owned(m, recipe_hash):  # e.g. saved before an on_drift = "resume" changed the recipe
                    skipped.append(f"{src.name}: its manifest names recipe {str(m.get('recipe_hash'))[:8]}, "
                                   f"not this run's; not published")
                    continue
                if src.name in foreign:
                    problems.append(foreign_problem(persistent / src.name, foreign[src.name], recipe_hash))
                    continue
                if same_content(m, pub.get(src.name)):
                    continue
                prev = [n for n in pub if ck.CKPT_RE.fullmatch(n) and pub[n] and ck.step_of(n) < s]
                link = persistent / max(prev, key=ck.step_of) if prev and src == dirs[0] else None
                n, why = _publish(src, persistent, m, link, opts)
                if why and why.startswith("persistent_dir") and _prune_for_space(persistent, pub, wanted, deleted):
                    n, why = _publish(src, persistent, m, link, opts)
                nbytes += n
                if why == CANCELLED:
                    skipped.append(f"{src.name}: cancelled by stop()")
                elif why and why.startswith(REFUSED):
                    skipped.append(why.removeprefix(REFUSED))
                elif why:
                    problems.append(why)
                else:
                    copied.append(src.name)
                    pub[src.name] = m
        kept = retain(_losses(pub), keep)
        for name in sorted(pub):
            if ck.step_of(name) not in kept:
                _remove(persistent / name)
                deleted.append(name)
        newest_pub = max(kept, default=None)
        behind = sorted(s for s in local if newest_pub is None or s > newest_pub)  # what losing the node loses
        lag_s = None if newest is None else 0.0 if not behind else \
            max(0.0, time.time() - Path(local[behind[0]].path).stat().st_mtime)
        lag = None if newest is None or newest_pub is None else max(0, newest - newest_pub)
        r = SyncResult(tuple(copied), nbytes, tuple(skipped), tuple(problems), tuple(deleted), newest,
                       newest_pub, lag, lag_s, synced=all(p.startswith("local ") for p in problems))
    except OSError as e:
        r = SyncResult(tuple(copied), nbytes, tuple(skipped), (*problems, f"sync to {persistent} failed: {e}"),
                       tuple(deleted))
    finally:
        os.close(lock_fd)
        if in_flight is not None:
            in_flight.release()
    return _report(r, on_problem, t0)


def _prune_for_space(persistent: Path, pub: dict, wanted: set[int], deleted: list[str]) -> bool:
    """Drop published copies that retention will drop anyway (never the newest); True if any went."""
    steps = [ck.step_of(n) for n in pub if ck.CKPT_RE.fullmatch(n)]
    newest = max(steps, default=None)
    gone = [n for n in list(pub) if ck.step_of(n) not in wanted and ck.step_of(n) != newest]
    for n in gone:
        _remove(persistent / n)
        deleted.append(n)
        del pub[n]
    return bool(gone)


def _report(r: SyncResult, on_problem: Callable[[str], None] | None, t0: float) -> SyncResult:
    if on_problem is not None:
        for p in r.problems:
            try:
                on_problem(p)
            except Exception:  # an alert hook must not break syncing
                log.exception("on_problem hook failed")
    return replace(r, duration_s=time.monotonic() - t0)


def restore(persistent_dir: str | os.PathLike, output_dir: str | os.PathLike, step: int | None = None,
            include_merged: bool = False, recipe_hash: str | None = None) -> Path:
    """Copy published checkpoint-`step` (newest when None) into output_dir, verified, atomically.
    With `recipe_hash`, only copies whose manifest names it (others are another run's)."""
    persistent, out = Path(persistent_dir), Path(output_dir)
    try:
        pub = _published(persistent)
    except OSError as e:
        raise SyncError(f"cannot read persistent_dir {persistent}: {e.strerror or e}") from e
    steps = sorted(ck.step_of(n) for n in pub if ck.CKPT_RE.fullmatch(n))
    step = steps[-1] if step is None and steps else step
    if step not in steps:
        raise SyncError(f"no published checkpoint-{step} in {persistent} (published: {steps})")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SyncError(f"cannot create output_dir {out}: {e.strerror or e}") from e
    names = [f"checkpoint-{step}"] + ([f"checkpoint-{step}-merged"] if include_merged
                                      and f"checkpoint-{step}-merged" in pub else [])
    for name in names:
        m, final, staging = pub[name], out / name, out / f"{PARTIAL}{name}"
        if m is None:
            raise SyncError(f"{persistent / name} has no {mf.MANIFEST}: it cannot be verified; not restoring it")
        if recipe_hash is not None and not owned(m, recipe_hash):
            raise SyncError(f"{persistent / name} is another run's copy (recipe {str(m.get('recipe_hash'))[:8]}, "
                            f"this run is {recipe_hash[:8]}): not restoring it")
        if final.exists():
            if same_content(mf.read_manifest(final), m) and not mf.manifest_matches(final, m):
                continue
            raise SyncError(f"{final} exists and differs from the published copy: move it away, then restore")
        need, free = sum(f["size"] for f in m["files"]), shutil.disk_usage(out).free
        if free < need:
            raise SyncError(f"output_dir {out} has {free / GIB:.1f} GiB free, needs {need / GIB:.1f} GiB")
        try:
            _, digests = _copy(persistent / name, staging, m, None, (), None, None, None)
            bad = _check_copy(staging, m, digests)
            if not bad:
                mf.write_json_atomic(staging / mf.MANIFEST, m)
                os.rename(staging, final)
                mf.fsync_dir(out)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise SyncError(f"restoring {name} from {persistent} into {out} failed: {e}") from e
        if bad:
            shutil.rmtree(staging, ignore_errors=True)
            raise SyncError(f"restored copy of {name} does not match its manifest ({bad[0]}): the published "
                            f"copy is damaged; restore an older step")
    return out / names[0]
