"""A new journal after a damaged one was moved aside (host/journal_health.py): what the disk still tells is
written back, and the `journal_replaced` event says what was wrong, what was rebuilt and what was lost.

The disk tells: the run's verified checkpoints (local ones whose manifest names this recipe's hash and still
matches their files), its published copies (persistent_dir, this hash), and how many attempts ran (their
logs, so attempt numbers go on after them). It does not tell the crash history (the policy's crash counts and
NaN streak start over), the attempts' exits and classes, or the goodput before now.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.recipe import Recipe
from orchestrator.domain.checkpoint_names import CKPT_RE, step_of
from orchestrator.host.journal import Journal
from orchestrator.host.journal_health import JournalDamage
from orchestrator.store.manifest import manifest_stale, read_manifest
from orchestrator.store.published import published

ATTEMPT_LOG_RE = re.compile(r"attempt-(\d+)\.log")
LOST = ("crash history (crash counts and the NaN streak start over)", "attempts' exits and classes",
        "goodput before now")


@dataclass(frozen=True)
class Rebuilt:
    """What a replaced journal was rebuilt with."""
    local: tuple[int, ...]          # steps of the verified local checkpoints of this recipe
    published: tuple[int, ...]      # steps of its published copies (merged ones aside)
    attempts_logged: int            # the highest attempt-NNNN.log: the next attempt is numbered after it
    published_unreadable: str = ""  # why persistent_dir could not be listed, when it could not


def local_verified(out: Path, recipe_hash: str) -> dict[int, tuple[Path, dict]]:
    """step -> (path, manifest) of the checkpoints in `out` whose manifest names `recipe_hash` and still
    describes their files (we write manifests for verified checkpoints only)."""
    found = {}
    try:
        dirs = [d for d in out.iterdir() if CKPT_RE.fullmatch(d.name) and d.is_dir()]
    except OSError:
        return {}
    for d in dirs:
        m = read_manifest(d)
        if m is not None and m.get("recipe_hash") == recipe_hash and not manifest_stale(d, m):
            found[step_of(d.name)] = (d, m)
    return found


def attempts_logged(state_dir: Path) -> int:
    """The highest attempt number with a log in `state_dir`/attempts (0 when none)."""
    try:
        names = [p.name for p in (state_dir / "attempts").iterdir()]
    except OSError:
        return 0
    return max((int(m.group(1)) for n in names if (m := ATTEMPT_LOG_RE.fullmatch(n))), default=0)


def rebuild_journal(journal: Journal, damage: JournalDamage, r: Recipe, recipe_hash: str, out: Path,
                    state_dir: Path) -> Rebuilt:
    """Write what the disk tells into the new `journal` and record `journal_replaced`; returns what was rebuilt."""
    local = local_verified(out, recipe_hash)
    for step, (path, m) in sorted(local.items()):
        journal.record_checkpoint(step, str(path), True, loss=m.get("loss"), recipe_hash=recipe_hash,
                                  saved_at=m.get("created_at"))
    steps, unreadable = [], ""
    if r.run.persistent_dir:
        try:
            copies = published(r.run.persistent_dir, r.run.name, recipe_hash)
        except OSError as e:
            copies, unreadable = [], f"{r.run.persistent_dir}: {e.strerror or e}"
        for c in copies:
            if c.merged:
                continue
            if c.step not in local:  # only published now (local retention deleted it): the copy is the record
                journal.record_checkpoint(c.step, str(c.path), True, loss=c.manifest.get("loss"),
                                          recipe_hash=recipe_hash, saved_at=c.manifest.get("created_at"))
            journal.mark_synced(c.step)
            steps.append(c.step)
        if merged := sorted(c.step for c in copies if c.merged):
            journal.put(merged_synced=merged)
    rebuilt = Rebuilt(tuple(sorted(local)), tuple(sorted(steps)), attempts_logged(state_dir), unreadable)
    journal.event("journal_replaced", replaced_message(damage, rebuilt), old=str(damage.path),
                  moved_to=str(damage.moved_to), problem=damage.problem,
                  rebuilt={"checkpoints": list(rebuilt.local), "published": list(rebuilt.published),
                           "attempts_logged": rebuilt.attempts_logged},
                  lost=list(LOST))
    return rebuilt


def replaced_message(damage: JournalDamage, rebuilt: Rebuilt) -> str:
    """The console line and event message: the old file, what was wrong, what was rebuilt, what was lost."""
    newest = f", newest checkpoint-{rebuilt.local[-1]}" if rebuilt.local else ""
    published_part = (f"persistent_dir unreadable ({rebuilt.published_unreadable})" if rebuilt.published_unreadable
                      else f"{len(rebuilt.published)} published")
    return (f"{damage.path.name}: {damage.problem}; moved aside to {damage.moved_to.name} and a new journal started. "
            f"Rebuilt from disk: {len(rebuilt.local)} verified checkpoint(s){newest}, {published_part}, "
            f"{rebuilt.attempts_logged} earlier attempt log(s). Lost: {', '.join(LOST)}. "
            f"The run resumes from the newest verified checkpoint of this recipe")
