"""The run's checkpoints as the supervisor tracks them: each verified once as it appears (the checkpoint_invalid
alert raised at once when bad, cleared when a newer one verifies ok), manifests hashed off the loop, NaN-poisoned
ones quarantined, and the resume point chosen."""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator import checkpoints, manifest
from orchestrator.journal import Journal
from orchestrator.metrics import Metrics
from orchestrator.recipe import Recipe
from orchestrator.types import Alert, CheckpointInfo, Resume


class RunCheckpoints:
    def __init__(self, recipe: Recipe, recipe_hash: str, out: Path, journal: Journal, metrics: Metrics,
                 on_saved: Callable[[], None], restore: Callable[[], CheckpointInfo | None]):
        """`on_saved`: a verified checkpoint (and its manifest) is ready to sync; `restore`: copy the newest
        published checkpoint back when none is usable locally."""
        self.recipe, self.hash, self.out = recipe, recipe_hash, out
        self.journal, self.metrics, self.on_saved, self.restore = journal, metrics, on_saved, restore
        self.seen: dict[str, bool] = {}  # path -> verified ok; complete checkpoints are verified once
        # (step, ok) of the newest checkpoint verified so far (a rewrite of that step replaces it):
        # the checkpoint_invalid alert is raised exactly while it failed. Unlike `seen`, never forgotten.
        self.newest_verdict: tuple[int, bool] | None = None
        lora = recipe.lora
        self.expect = checkpoints.LoraExpect(lora.rank, lora.alpha, tuple(lora.target_modules))
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")

    def scan(self, now: float) -> None:
        for info in checkpoints.discover(self.out, self.recipe.run.backend, self.expect, skip=self.seen):
            if not info.complete:
                continue
            self.seen[info.path] = info.ok
            self._verdict(info.step, info.ok)
            saved = _mtime(info.path, now)
            self.journal.record_checkpoint(info.step, info.path, info.ok, info.problems, info.loss, self.hash, saved)
            if info.ok:
                self.metrics.checkpoint_saved(info.step, saved)
                self.journal.event("checkpoint", f"verified {Path(info.path).name}")
                if manifest.read_manifest(info.path) is None:
                    # Hashing a large checkpoint takes seconds to minutes: never in the loop.
                    self.hasher.submit(manifest.write_manifest, info.path, info.step, self.hash,
                                       info.loss).add_done_callback(lambda _f: self.on_saved())
                else:
                    self.on_saved()
            else:
                self.metrics.checkpoint_invalid()
                self.journal.event("checkpoint_invalid", f"{Path(info.path).name}: " + "; ".join(info.problems))

    def _verdict(self, step: int, ok: bool) -> None:
        before = self.newest_verdict
        if before is None or step >= before[0]:  # discover() goes by step: the newest is verified last
            self.newest_verdict = (step, ok)
            if (before is not None and not before[1]) != (not ok):
                self.metrics.alert(Alert.CHECKPOINT_INVALID, not ok)

    def newest_good_step(self) -> int:
        return max((_step(p) for p, ok in self.seen.items() if ok), default=-1)

    def forget_after(self, step: int) -> None:
        """A new attempt rewrites any checkpoint after its resume point: verify those afresh."""
        self.seen = {p: ok for p, ok in self.seen.items() if _step(p) <= step}

    def resume_point(self) -> Resume | None:
        best = None
        for info in checkpoints.scan(self.out, self.recipe.run.backend, self.expect, newest_first=True):
            best, passed = checkpoints.pick_resume([info], {info.path: manifest.read_manifest(info.path)},
                                                   self.hash, require_manifest=False)
            for why in passed:
                self.journal.event("resume_skip", why)
            if best is not None:  # newest first: stop at the first acceptable one
                break
        if best is None:
            best = self.restore()
            if best is None:
                return None
        return Resume(best.path, best.step, weights_only=not self.recipe.checkpoint.keep_optimizer)

    def quarantine(self, nan_step: int, attempt_n: int) -> None:
        """Checkpoints from the NaN step on (a save on the SIGTERM that stopped the attempt, say) may
        hold poisoned weights: move them out of the resume path, keeping the data for a person."""
        for d in sorted(self.out.glob("checkpoint-*")):
            m = checkpoints.CKPT_RE.fullmatch(d.name) or checkpoints.MERGED_RE.fullmatch(d.name)
            if m and int(m.group(1)) >= nan_step:
                target = d.with_name(f"{d.name}.nan-attempt-{attempt_n}")
                d.rename(target)
                self.seen.pop(str(d), None)
                self.journal.event("quarantine", f"{d.name} was written at or after the NaN at step {nan_step}: "
                                   f"moved to {target.name}, never resumed from")
        self._repoint_last_checkpoint(nan_step)
        self.journal.put(nan_pending=None)

    def _repoint_last_checkpoint(self, below: int) -> None:
        """ms-swift's last-checkpoint must not name a quarantined step: the relaunch writes a new,
        maybe unfinished, directory of that name, which the stale link would vouch for."""
        link = self.out / "last-checkpoint"
        try:
            if _step(os.readlink(link)) < below:
                return
        except (OSError, ValueError, IndexError):
            return
        kept = sorted((d for d in self.out.glob("checkpoint-*") if checkpoints.CKPT_RE.fullmatch(d.name)
                       and _step(str(d)) < below), key=lambda d: _step(str(d)))
        if kept:
            tmp = link.with_name("last-checkpoint.orchestrator-tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(kept[-1].name)
            os.replace(tmp, link)
        else:
            link.unlink()

    def close(self) -> None:
        self.hasher.shutdown(wait=True)  # manifests first: the final sync publishes what they describe


def _mtime(path: str, default: float) -> float:
    """When the trainer finished writing the checkpoint: its newest file (not the directory, whose
    mtime moves when our manifest is written into it)."""
    try:
        return max((os.stat(os.path.join(path, f)).st_mtime for f in manifest.list_files(path)),
                   default=Path(path).stat().st_mtime)
    except OSError:
        return default


def _step(checkpoint_path: str) -> int:
    return int(Path(checkpoint_path).name.split("-")[1])
