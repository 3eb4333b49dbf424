"""The supervisor's side of persistent sync: start the sync thread, report its rounds into the
journal and metrics (from the main loop, so the thread never touches them), restore from
persistent storage when the local disk has nothing to resume from (the new-spot-instance case)."""
from __future__ import annotations

import time
from pathlib import Path

from orchestrator import checkpoints, manifest, sync
from orchestrator.recipe import Recipe, recipe_hash
from orchestrator.types import CheckpointInfo


def _sync_args(r: Recipe, h: str) -> dict:
    return dict(output_dir=r.run.output_dir, persistent_dir=r.run.persistent_dir, backend=r.run.backend,
                recipe_hash=h, keep=r.checkpoint.keep_persistent, include_mcore=r.checkpoint.keep_optimizer,
                include_merged=r.checkpoint.merge_lora)


def sync_recipe(r: Recipe) -> dict:
    """`orchestrator sync RECIPE --once`."""
    res = sync.sync_once(**_sync_args(r, recipe_hash(r)))
    return {"copied": len(res.copied), "names": list(res.copied), "bytes": res.bytes_copied,
            "skipped": list(res.skipped), "problems": list(res.problems), "deleted": list(res.deleted),
            "newest_published": res.newest_published, "synced": res.synced}


class Sidecar:
    def __init__(self, recipe: Recipe, h: str, journal, metrics):
        self.recipe, self.hash, self.journal, self.metrics = recipe, h, journal, metrics
        self.thread: sync.SyncSidecar | None = None
        self.problems: list[str] = []
        self.seen_rounds = 0

    @property
    def enabled(self) -> bool:
        return self.recipe.run.persistent_dir is not None

    def start(self) -> None:
        if self.enabled:
            a = _sync_args(self.recipe, self.hash)
            self.thread = sync.SyncSidecar(a.pop("output_dir"), a.pop("persistent_dir"), a.pop("backend"),
                                           a.pop("recipe_hash"), interval_s=self.recipe.checkpoint.sync_interval_s,
                                           on_problem=self.problems.append, **a)
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
        # What is published now, from persistent_dir itself: a round's result can be superseded
        # before this runs, the directory cannot.
        published = {int(m.group(1)) for d in Path(self.recipe.run.persistent_dir).glob("checkpoint-*")
                     if (m := checkpoints.CKPT_RE.fullmatch(d.name))}
        for c in self.journal.checkpoints():
            if c["ok"] and c["synced_at"] is None and c["step"] in published:
                self.journal.mark_synced(c["step"])
                self.journal.event("synced", f"published checkpoint-{c['step']} to {self.recipe.run.persistent_dir}")

    def stop(self, final_sync: bool) -> None:
        if self.thread:
            self.thread.stop(final_sync=final_sync)
            self.report()

    def restore_newest(self) -> CheckpointInfo | None:
        """Newest published checkpoint of this recipe, copied back and verified; None if none."""
        if not self.enabled:
            return None
        persistent = Path(self.recipe.run.persistent_dir)
        steps = []
        for d in persistent.glob("checkpoint-*"):
            m = checkpoints.CKPT_RE.fullmatch(d.name)
            published = manifest.read_manifest(d) if m else None
            if published and published.get("recipe_hash") == self.hash:
                steps.append(int(m.group(1)))
        for step in sorted(steps, reverse=True):
            try:
                path = sync.restore(persistent, self.recipe.run.output_dir, step,
                                    include_merged=self.recipe.checkpoint.merge_lora)
            except sync.SyncError as e:
                self.journal.event("restore_failed", str(e))
                continue
            v = checkpoints.verify(path, backend=self.recipe.run.backend)
            if v.ok:
                self.journal.event("restored", f"restored {path.name} from {persistent}", at=time.time())
                return v.to_info()
            self.journal.event("restore_failed", f"{path}: " + "; ".join(v.problems))
        return None
