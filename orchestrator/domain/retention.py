"""Local retention: which local checkpoints (and merged copies) may be deleted now. A pure function.

At 397B a save is hundreds of GiB and the node's NVMe holds a handful, so the orchestrator owns local
retention, not only published retention: keep the newest K verified checkpoints. Never deleted, whatever
the pressure: the resume point (the newest verified checkpoint), a checkpoint still being written
(incomplete), one not yet published when a persistent_dir is set, and anything that failed verification
(evidence for a person; quarantine keeps the data too). A local merged copy goes once it is published,
unless the recipe keeps them; an unpublished merged copy is kept even when its checkpoint goes (the final
export's copy appears after its checkpoint was published). Under disk pressure only the resume point and the unpublished are kept.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Local:
    """One local checkpoint as retention sees it."""

    step: int
    path: str
    complete: bool                 # completeness markers present: not being written
    ok: bool                       # verified
    published: bool                # its copy on persistent storage is verified (journal synced_at)
    merged_path: str | None = None
    superseded: bool = False       # unpublished and older than the newest verified: sync copies only the newest
    merged_published: bool = False  # its merged copy is published (it may appear after the checkpoint was)

    @property
    def released(self) -> bool:
        """Its local copy is not the only one that matters: published, or never to be published."""
        return self.published or self.superseded


@dataclass(frozen=True)
class Prune:
    path: str
    reason: str


def plan_prune(local: list[Local], keep: int, persistent: bool, keep_merged: bool,
               pressure: bool = False, writing: bool = True) -> list[Prune]:
    """What may be deleted now, oldest first. `persistent`: a persistent_dir is set (unpublished copies are
    the only ones); `pressure`: the disk cannot take the next save, keep no more than retention must;
    `writing`: a trainer is running (an incomplete checkpoint may be the save in progress). With no trainer,
    an incomplete checkpoint is one torn by a save that crashed: never resumable, and the relaunch rewrites it."""
    torn = [] if writing else [Prune(c.path, f"checkpoint-{c.step} was torn by a crashed save")
                               for c in sorted(local, key=lambda c: c.step) if not c.complete]
    good = sorted((c for c in local if c.complete and c.ok), key=lambda c: c.step)
    if not good:
        return torn
    resume = good[-1]
    kept = {c.step for c in good[-(1 if pressure else max(1, keep)):]}
    out: list[Prune] = []
    for c in good:
        unpublished = persistent and not c.released
        if c.step in kept or c is resume or unpublished:
            if c.merged_path and c.merged_published and not keep_merged:  # resume never reads the merged copy
                out.append(Prune(c.merged_path, f"merged copy of checkpoint-{c.step} is published"))
            continue
        why = "disk pressure: " if pressure else ""
        where = ", published" if c.published else ", superseded (only the newest is published)" if persistent else ""
        out.append(Prune(c.path, f"{why}older than the newest {1 if pressure else keep} verified{where}"))
        if c.merged_path and not (persistent and not (c.merged_published or c.superseded)):
            out.append(Prune(c.merged_path, f"merged copy of pruned checkpoint-{c.step}"))
    return torn + out
