"""The supervisor's side of persistent sync: start the sync thread, report its rounds into the
journal and metrics (from the main loop, so the thread never touches them), restore from
persistent storage when the local disk has nothing to resume from (the new-spot-instance case).
Only the run's own copies count (published.published: its publish dir, its recipe hash)."""
from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.store import checkpoints, sync
from orchestrator.host.journal import Journal, journal_path
from orchestrator.store.checkpoint_health import CheckpointHealth
from orchestrator.store.standing import SetAside, Standings
from orchestrator.store.sync_thread import SyncThread
from orchestrator.store import manifest as mf
from orchestrator.store.published import PublishLock, publish_dir, published
from orchestrator.config.recipe import Recipe, RecipeError, recipe_hash, semantic_view
from orchestrator.store.rundir import place, state_dir
from orchestrator.types import GIB, CheckpointInfo, Standing



def _sync_args(r: Recipe, h: str) -> dict:
    if r.run.persistent_dir is None:  # callers publish only with it set: the sync command refuses, start() checks
        raise RecipeError("run.persistent_dir is not set in the recipe: nothing to sync to")
    return dict(output_dir=r.run.output_dir, persistent_dir=publish_dir(r.run.persistent_dir, r.run.name, h),
                backend=r.run.backend, recipe_hash=h, keep=r.checkpoint.keep_persistent,
                include_mcore=r.checkpoint.keep_optimizer, include_merged=r.checkpoint.merge != "never")


def sync_recipe(r: Recipe) -> dict:
    """`orchestrator sync RECIPE --once`: one round from the run's output dir (the drifted one when the
    recipe changed, as `run` would place it) into its own publish dir. RecipeError (exit 2) when a
    supervisor of another output dir publishes there; with its own run's supervisor alive it runs,
    serialised with the supervisor's rounds by the sync lock (both publish the same checkpoints)."""
    h = recipe_hash(r)
    try:
        out = place(r.run.output_dir, h, semantic_view(r), "resume" if r.run.on_drift == "resume" else "fresh")
    except RecipeError:
        out = None
    if out is not None and out.output_dir != Path(r.run.output_dir):
        r = r.model_copy(update={"run": r.run.model_copy(update={"output_dir": str(out.output_dir)})})
    PublishLock(r.run.persistent_dir, r.run.name, h, r.run.output_dir).check_for_sync()
    args = _sync_args(r, h)
    res = sync.sync_once(**args, gate=_offline_gate(Path(r.run.output_dir)))
    return {"copied": len(res.copied), "names": list(res.copied), "bytes": res.bytes_copied,
            "skipped": list(res.skipped), "problems": list(res.problems), "deleted": list(res.deleted),
            "newest_published": res.newest_published, "synced": res.synced,
            "output_dir": str(r.run.output_dir), "destination": str(args["persistent_dir"])}


def _offline_gate(out: Path) -> Callable[[int, str], str | None]:
    """`sync --once`'s gate: the standing the run's journal records; a checkpoint it has not judged (no supervisor
    checked it yet) is content-checked here, before it is published."""
    try:
        journal: Journal | None = Journal(journal_path(state_dir(out)), readonly=True)
    except (OSError, sqlite3.Error):
        journal = None
    try:
        standings = Standings(journal)
    except sqlite3.Error:
        standings = Standings(None)
    finally:
        if journal is not None:
            journal.close()
    health = CheckpointHealth(out)

    def gate(step: int, path: str) -> str | None:
        e = standings.of(step)
        if e is not None and e.path == path and e.standing not in (Standing.WRITTEN, Standing.VERIFIED):
            return standings.publish_refusal(step, path)
        found = health.check(path, step)
        return None if found is None else found.message
    return gate


class Publisher:
    def __init__(self, recipe: Recipe, h: str, journal, metrics, standings: Standings | None = None):
        """`standings`: the owner of each checkpoint's standing; a round publishes only what it calls usable."""
        self.recipe, self.hash, self.journal, self.metrics = recipe, h, journal, metrics
        self.standings = standings if standings is not None else Standings(journal)
        self.lock_waits: list[SetAside] = []   # set-asides said to wait for the sync lock (said once each)
        self.thread: SyncThread | None = None
        self.in_flight = sync.InFlight()  # shared with local retention (CheckpointTracker.prune)
        self.problems: list[str] = []
        self.seen_rounds = 0

    @property
    def enabled(self) -> bool:
        return self.recipe.run.persistent_dir is not None

    def start(self) -> None:
        if self.enabled:
            a = _sync_args(self.recipe, self.hash)
            c = self.recipe.checkpoint
            self.metrics.publish_interval(c.publish_interval_s)
            self.thread = SyncThread(a.pop("output_dir"), a.pop("persistent_dir"), a.pop("backend"), a.pop("recipe_hash"),
                                     interval_s=c.sync_interval_s, publish_interval_s=c.publish_interval_s,
                                     on_problem=self.problems.append, in_flight=self.in_flight,
                                     gate=self.standings.publish_refusal, **a)
            self.thread.start()

    def trigger(self) -> None:
        if self.thread:
            self.thread.trigger()

    def report(self) -> None:
        """Called from the main loop: fold finished sync rounds into metrics and the journal."""
        t = self.thread
        if t is None or t.rounds == self.seen_rounds:
            return
        self.seen_rounds = t.rounds
        res = t.last_result
        while self.problems:
            msg = self.problems.pop(0)
            self.journal.event("sync_problem", msg)
        if res is not None:
            self.metrics.sync_done(res.bytes_copied, res.lag_s or 0.0)
        # What is published now, from the run's own copies: a round's result can be superseded
        # before this runs, the directory cannot.
        try:
            copies = self._published()
        except OSError:
            return
        mine = {c.step: c for c in copies if not c.merged}
        for c in self.journal.checkpoints():
            if c["ok"] and c["synced_at"] is None and c["step"] in mine:
                self.journal.mark_synced(c["step"])
                self.journal.event("synced", f"published checkpoint-{c['step']} to {mine[c['step']].dir}")
        for step in self.standings.steps(Standing.HEALTHY):  # healthy -> published once its very save is there
            e = self.standings.of(step)
            if e is None or step not in mine or (local := mf.read_manifest(e.path)) is None:
                continue
            pub = mine[step].manifest
            if sync.same_content(sync.filter_manifest(local, tuple(pub.get("excluded", ()))), pub):
                self.standings.move(step, e.path, Standing.PUBLISHED)
        # merged copies (published in a later round than their checkpoint for merge = "final"): local
        # retention deletes a local merged copy only once its step is listed here
        merged = {c.step: c for c in copies if c.merged}
        known = set(self.journal.get_all().get("merged_synced") or ())
        if set(merged) != known:
            self.journal.put(merged_synced=sorted(merged))
            for step in sorted(set(merged) - known):
                self.journal.event("synced", f"published checkpoint-{step}-merged to {merged[step].dir}")

    def _published(self) -> list:
        r = self.recipe.run
        if r.persistent_dir is None:  # every caller runs only when publishing is on (enabled)
            raise RuntimeError("no published copies to list: run.persistent_dir is not set")
        return published(r.persistent_dir, r.name, self.hash)

    def stop(self, final_sync: bool) -> None:
        if self.thread:
            self.thread.stop(final_sync=final_sync)
            self.report()

    def start_restore(self) -> None:
        """Copy the newest published checkpoint back in a background thread (hundreds of GB at 397B: the
        loop must keep pinging the watchdog). Only what a resume reads: never the merged copy. The thread
        writes no journal: its notes are folded in by the loop (finish_restore)."""
        self.restore_notes: list[tuple[str, str, dict]] = []
        self.restore_result: CheckpointInfo | None = None
        self.restore_done = threading.Event()

        def run() -> None:
            try:
                self.restore_result = self._restore_newest(self.restore_notes)
            except Exception as e:  # noqa: BLE001 - a failed restore is a journal note, never a dead loop
                self.restore_notes.append(("restore_failed", f"restore failed: {e}", {}))
            finally:
                self.restore_done.set()

        threading.Thread(target=run, name="restore", daemon=True).start()

    def restore_copied_bytes(self) -> int:
        """Bytes in the restore's staging directories so far (its progress)."""
        total = 0
        for d in Path(self.recipe.run.output_dir).glob(f"{sync.PARTIAL}*"):
            try:  # the restore renames a staging directory into place while this walks it
                total += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            except OSError:
                pass
        return total

    def finish_restore(self) -> CheckpointInfo | None:
        for kind, message, data in self.restore_notes:
            self.journal.event(kind, message, **data)
        return self.restore_result

    def set_aside_published(self, req: SetAside, wait_s: float = 0.0) -> bool:
        """Renames the run's published copies `req` covers (from_step through through_step, or that one step) out
        of the published names, under the sync lock (at most `wait_s` for it), so no restore takes them and no
        round re-lists them; the data stays for a person. Returns True when none is left to move; False when the
        lock is held by a round (the request is retried on a later pass)."""
        r = self.recipe.run
        if r.persistent_dir is None:  # not enabled: nothing published to move
            return True
        try:  # nothing it covers is published: no lock needed (the gate keeps anything it covers from a round)
            if not any(req.covers(c.step) for c in self._published()):
                return True
        except OSError:
            pass
        try:
            fd = sync.open_lock(publish_dir(r.persistent_dir, r.name, self.hash), wait_s=wait_s)
        except BlockingIOError:
            if req not in self.lock_waits:
                self.lock_waits.append(req)
                self.journal.event("quarantine", f"published copies from checkpoint-{req.from_step} wait for the sync "
                                   "lock to be set aside (retried every pass)", step=req.from_step)
            return False
        except OSError as e:
            self.journal.event("quarantine", f"published copies from checkpoint-{req.from_step}: {e}; retried")
            return False
        moved, left = [], False
        try:
            for c in self._published():
                if req.covers(c.step):
                    tag = req.reason.tag
                    target = (c.path.with_name(f"{c.path.name}.{tag}") if req.only_step
                              else checkpoints.quarantine_name(c.path, req.attempt, tag))
                    try:
                        c.path.rename(target)
                        moved.append(c.name)
                    except OSError as e:
                        left = True
                        self.journal.event("quarantine", f"published {c.name}: {e}; retried")
        except OSError as e:
            left = True
            self.journal.event("quarantine", f"published copies from checkpoint-{req.from_step}: {e}; retried")
        finally:
            os.close(fd)
        if moved:
            self.journal.event("quarantine", f"published {', '.join(moved)}: {req.cause}: renamed *.{req.reason.tag}"
                               + ("" if req.only_step else f"-attempt-{req.attempt}") + ", never restored from")
        return not left

    def _restore_newest(self, notes: list) -> CheckpointInfo | None:
        """Newest published checkpoint of this run (its publish dir, else the flat layout of an earlier
        release; manifest naming this recipe hash), copied back and verified; None if none."""
        try:
            copies = [c for c in self._published() if not c.merged]
        except OSError as e:
            notes.append(("restore_failed", f"cannot read {self.recipe.run.persistent_dir}: {e.strerror or e}", {}))
            return None
        for c in sorted(copies, key=lambda c: c.step, reverse=True):
            size = sum(f.get("size", 0) for f in (mf.read_manifest(c.path) or {}).get("files", []))
            notes.append(("restore", f"restoring checkpoint-{c.step} from {c.path} ({size / GIB:.1f} GiB)",
                          {"bytes": size}))
            self.restore_bytes = size
            try:
                path = sync.restore(c.dir, self.recipe.run.output_dir, c.step, recipe_hash=self.hash,
                                    include_merged=False)
            except sync.SyncError as e:
                notes.append(("restore_failed", str(e), {}))
                continue
            v = checkpoints.verify(path, backend=self.recipe.run.backend)
            if v.ok:
                layout = ", flat layout of an earlier release" if c.flat else ""
                notes.append(("restored", f"restored {path.name} from {c.path} (recipe {self.hash[:8]}{layout})",
                              {"source": str(c.path), "step": c.step, "flat": c.flat}))
                return v.to_info()
            notes.append(("restore_failed", f"{path}: " + "; ".join(v.problems), {}))
        return None
