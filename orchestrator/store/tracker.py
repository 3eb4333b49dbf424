"""The run's checkpoints as the supervisor tracks them: each verified once as it appears (the checkpoint_invalid
alert raised at once when bad, cleared when a newer one verifies ok), manifests hashed off the loop, NaN-poisoned
ones quarantined, stale or non-finite ones (store/checkpoint_health.py, checked after the manifest on the same
thread) moved out of the resume path, and the resume point chosen."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.store import checkpoint_health, checkpoints, manifest
from orchestrator.domain import retention
from orchestrator.store.checkpoints import step_of
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.config.recipe import Recipe
from orchestrator.store.sync import InFlight
from orchestrator.types import Alert, CheckpointInfo, Resume


PRUNING = ".orchestrator-pruning-"   # a checkpoint being deleted by retention


class CheckpointTracker:
    def __init__(self, recipe: Recipe, recipe_hash: str, out: Path, journal: Journal, metrics: Metrics,
                 on_saved: Callable[[], None], in_flight: InFlight | None = None, act: bool = True):
        """`on_saved`: a verified checkpoint (and its manifest) is ready to sync. `in_flight`: the checkpoint
        the publisher is copying, never pruned. `act` False (`orchestrator watch`): nothing of the run is renamed
        or deleted; an unhealthy checkpoint is recorded and left in place (`left_in_place`), never pruned."""
        self.recipe, self.hash, self.out, self.act = recipe, recipe_hash, out, act
        self.left_in_place: list[checkpoint_health.HealthFinding] = []  # act False: what a supervisor would move
        self.in_flight = in_flight or InFlight()
        self.journal, self.metrics, self.on_saved = journal, metrics, on_saved
        self.seen: dict[str, bool] = {}  # path -> verified ok; complete checkpoints are verified once
        self.stale: dict[str, float | None] = {}  # path -> marker mtime: the old save a relaunch will rewrite
        self.unhashed: dict[str, tuple[int, float | None]] = {}  # manifests that failed: path -> (step, loss)
        # (step, ok) of the newest checkpoint verified so far (a rewrite of that step replaces it):
        # the checkpoint_invalid alert is raised exactly while it failed. Unlike `seen`, never forgotten.
        self.newest_verdict: tuple[int, bool] | None = None
        self.newest_problems: tuple[str, ...] = ()  # and why it failed
        lora = recipe.lora
        self.expect = checkpoints.LoraExpect(lora.rank, lora.alpha, tuple(lora.target_modules))
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")
        self.health = checkpoint_health.CheckpointHealth(out)
        for left in out.glob(f"{PRUNING}*") if act else ():  # a supervisor killed mid-delete: finish what it had decided
            shutil.rmtree(left, ignore_errors=True)

    def scan(self, now: float) -> None:
        self.apply_health()
        unchanged = {p for p, m in self.stale.items() if _marker_mtime(Path(p)) == m}
        for info in checkpoints.discover(self.out, self.recipe.run.backend, self.expect, skip=self.seen.keys() | unchanged):
            if not info.complete:
                continue
            if self.stale.pop(info.path, None) is not None:  # rewritten: its manifest described the old files
                (Path(info.path) / manifest.MANIFEST).unlink(missing_ok=True)
            self.seen[info.path] = info.ok
            self._verdict(info.step, info.ok, tuple(info.problems))
            saved = _mtime(info.path, now)
            self.journal.record_checkpoint(info.step, info.path, info.ok, info.problems, info.loss, self.hash, saved)
            if info.ok:
                self.metrics.checkpoint_saved(info.step, saved)
                self.journal.event("checkpoint", f"verified {Path(info.path).name}")
                if manifest.read_manifest(info.path) is None:
                    self._hash(info.path, info.step, info.loss)
                else:  # hashed and health-checked by an earlier supervisor (the same job writes both)
                    self.on_saved()
            else:
                self.metrics.checkpoint_invalid()
                self.journal.event("checkpoint_invalid", f"{Path(info.path).name}: " + "; ".join(info.problems))

    def _hash(self, path: str, step: int, loss: float | None) -> None:
        """The manifest, off the loop (hashing a large checkpoint takes minutes). One that fails (a full
        disk refuses even a small JSON) is retried by retry_manifests(), never left out for good."""
        def job() -> None:
            manifest.write_manifest(path, step, self.hash, loss)
            self._check_health(path, step)

        def done(f) -> None:
            if f.exception() is not None:
                self.unhashed[path] = (step, loss)
            self._saved_unless_unhealthy(path)
        self.unhashed.pop(path, None)
        self.hasher.submit(job).add_done_callback(done)

    def _check_health(self, path: str, step: int) -> None:
        """checkpoint_health's checks, on the manifest thread; what they find waits for apply_health()."""
        try:
            self.health.check(path, step)
        except Exception:  # a bug in a check must not cost the manifest or the run: the checkpoint stays usable
            pass

    def _saved_unless_unhealthy(self, path: str) -> None:
        """Wake the publisher, unless the checkpoint was just found unhealthy (it is about to be moved)."""
        if not any(f.path == path for f in self.health.peek()):
            self.on_saved()

    def apply_health(self) -> None:
        """Each checkpoint the health checks found stale (checkpoint_unchanged) or non-finite
        (checkpoint_nonfinite): moved out of the checkpoint-N namespace (so no resume, retention or
        publication takes it; the bytes stay for a person), recorded not ok, the checkpoint_invalid alert
        raised when it is the newest, and the event journaled with its numbers. One the publisher is copying
        right now waits for the next pass."""
        later = []
        for f in self.health.take():
            d = Path(f.path)
            if not self.act:  # watch mode: recorded and advised, the directory stays where the trainer wrote it
                self._left_in_place(f)
                continue
            with self.in_flight.lock:
                if self.in_flight.path == f.path:
                    later.append(f)
                    continue
                if not d.is_dir():  # pruned or quarantined meanwhile
                    continue
                target = checkpoint_health.unhealthy_name(d, f.kind)
                d.rename(target)
            merged = d.with_name(checkpoints.merged_name(d.name))
            if merged.is_dir():
                merged.rename(checkpoint_health.unhealthy_name(merged, f.kind))
            self.seen.pop(f.path, None)
            self.journal.record_checkpoint(f.step, f.path, False, f.problems, None, self.hash)
            self._verdict(f.step, False, f.problems)
            self.metrics.checkpoint_invalid()
            self.journal.event(f.kind, f"{f.problems[0]}; moved to {target.name}", **f.data)
            self.metrics.health_event(f.kind)
            link = self.out / "last-checkpoint"
            if os.path.islink(link) and os.readlink(link).rstrip("/").endswith(d.name):
                self._repoint_last_checkpoint(f.step)
        self.health.keep(later)

    def _left_in_place(self, f: checkpoint_health.HealthFinding) -> None:
        """An unhealthy checkpoint in watch mode: recorded not ok (no resume point, never published), the
        alert raised when it is the newest, the event journaled; its directory is not touched."""
        self.seen[f.path] = False
        self.left_in_place.append(f)
        self.journal.record_checkpoint(f.step, f.path, False, f.problems, None, self.hash)
        self._verdict(f.step, False, f.problems)
        self.metrics.checkpoint_invalid()
        self.journal.event(f.kind, f"{f.problems[0]}; left in place (watch mode)", **f.data)
        self.metrics.health_event(f.kind)

    def retry_manifests(self) -> None:
        for path, (step, loss) in list(self.unhashed.items()):
            if os.path.isdir(path):
                self._hash(path, step, loss)
            else:
                self.unhashed.pop(path)

    def _verdict(self, step: int, ok: bool, problems: tuple[str, ...]) -> None:
        before = self.newest_verdict
        if before is None or step >= before[0]:  # discover() goes by step: the newest is verified last
            self.newest_verdict, self.newest_problems = (step, ok), problems
            if (before is not None and not before[1]) != (not ok):
                self.metrics.alert(Alert.CHECKPOINT_INVALID, not ok)

    def verified_at(self, step: int) -> bool:
        """The newest checkpoint verified so far is the one saved at `step`, and it is good."""
        return self.newest_verdict == (step, True)

    def failed_at(self, step: int) -> tuple[str, ...]:
        """Why the newest checkpoint failed verification when it is the one saved at `step`; () otherwise."""
        return self.newest_problems if self.newest_verdict == (step, False) else ()

    def newest_good_step(self, through: int | None = None) -> int:
        """The newest verified step (no later than `through`), -1 if none."""
        steps = (step_of(p) for p, ok in self.seen.items() if ok)
        return max((s for s in steps if through is None or s <= through), default=-1)

    def good_steps(self) -> list[int]:
        """Every verified step, oldest first (where a rollback can go)."""
        return sorted(step_of(p) for p, ok in self.seen.items() if ok)

    def forget_after(self, step: int) -> None:
        """A new attempt rewrites every checkpoint after its resume point, in place: until a rewrite's
        completeness marker is newer than now, such a directory still holds the old save (complete-looking
        while half rewritten), so it is not verified; once rewritten, it is verified afresh."""
        self.seen = {p: ok for p, ok in self.seen.items() if step_of(p) <= step}
        self.stale = {str(d): _marker_mtime(d) for d in self.out.glob("checkpoint-*")
                      if checkpoints.CKPT_RE.fullmatch(d.name) and step_of(str(d)) > step}

    def resume_point(self) -> Resume | None:
        best = None
        for info in checkpoints.scan(self.out, self.recipe.run.backend, self.expect, newest_first=True):
            best, passed = checkpoints.pick_resume([info], {info.path: manifest.read_manifest(info.path)},
                                                   self.hash, require_manifest=False)
            for why in passed:
                self.journal.event("resume_skip", why)
            if best is not None:  # newest first: stop at the first acceptable one
                break
        return None if best is None else self.resume_from(best)

    def resume_from(self, best: CheckpointInfo) -> Resume:
        return Resume(best.path, best.step, weights_only=not self.recipe.checkpoint.keep_optimizer)

    def prune(self, keep: int, pressure: bool, writing: bool = True, trusted_through: int | None = None) -> int:
        """Local retention (retention.plan_prune) over the checkpoints verified so far: a checkpoint being
        written was never verified, so it is never a candidate. Each deletion is a rename out of the
        checkpoint namespace first, so a kill -9 mid-delete leaves no half checkpoint under its name.
        `trusted_through`: the last step read from the trainer's log without a NaN; a save after it may hold
        poisoned weights, so it neither counts among the newest kept nor supersedes anything yet.
        Returns how many were deleted (none when not `act`)."""
        if not self.act:
            return 0
        kv = self.journal.get_all()
        if (kv.get("nan_pending") or {}).get("step") is not None:  # a NaN seen, not yet quarantined: keep all
            return 0
        synced = {c["step"] for c in self.journal.checkpoints() if c["ok"] and c["synced_at"]}
        merged_synced = set(kv.get("merged_synced") or ())  # publisher.report keeps it
        newest = self.newest_good_step(trusted_through)
        torn = [] if writing else [retention.Local(i.step, i.path, False, False, False) for i in checkpoints.scan(
            self.out, self.recipe.run.backend, self.expect, skip=self.seen.keys()) if not i.complete]
        doomed = []
        with self.in_flight.lock:  # decided and renamed before the publisher can take one of them
            # the publisher copies only the newest: an older unpublished one never will be (superseded)
            local = [retention.Local(s, p, True, ok and s <= newest, s in synced, p + "-merged" if
                                     os.path.isdir(p + "-merged") else None, s < newest, merged_published=s in merged_synced)
                     for p, ok in self.seen.items()
                     if p != self.in_flight.path and os.path.isdir(p) and (s := step_of(p)) is not None]
            for prune in retention.plan_prune(local + torn, keep, self.recipe.run.persistent_dir is not None,
                                              keep_merged=False, pressure=pressure, writing=writing):
                path = Path(prune.path)
                try:
                    path.rename(path.with_name(f"{PRUNING}{path.name}"))
                except OSError as e:
                    self.journal.event("prune_failed", f"{path.name}: {e.strerror or e}")
                    continue
                doomed.append((prune.path, prune.reason))
        for name, reason in doomed:
            path = Path(name)
            self.seen.pop(name, None)
            shutil.rmtree(path.with_name(f"{PRUNING}{path.name}"), ignore_errors=True)
            self.journal.event("prune", f"deleted local {path.name}: {reason}")
            self.metrics.pruned(pressure)
        return len(doomed)

    def export_staging(self, checkpoint: str) -> Path:
        """The empty directory the final export writes into (a failed export's leftovers removed first:
        `--exist_ok` overwrites files, it does not remove stale ones)."""
        staging = self.out / checkpoints.export_staging_name(Path(checkpoint).name)
        shutil.rmtree(staging, ignore_errors=True)
        return staging

    def place_merged(self, checkpoint: str) -> tuple[Path, tuple[str, ...]]:
        """Verify the export of `checkpoint` (checkpoints.verify_merged) and rename it into place as
        checkpoint-N-merged. Returns (that path, problems); with problems nothing is renamed: a partial
        or damaged export never takes the published name."""
        name = Path(checkpoint).name
        staging, final = self.out / checkpoints.export_staging_name(name), self.out / checkpoints.merged_name(name)
        if final.is_dir() and not staging.exists():  # renamed by a supervisor killed before it recorded it
            return final, checkpoints.verify_merged(final).problems
        v = checkpoints.verify_merged(staging)
        if not v.ok:
            return final, v.problems
        if final.exists():  # an earlier export of the same checkpoint (a run continued after it): replaced
            shutil.rmtree(final)
        os.rename(staging, final)
        manifest.fsync_dir(self.out)
        return final, ()

    def quarantine(self, from_step: int, attempt_n: int, tag: str = "nan", cause: str = "") -> None:
        """Checkpoints from `from_step` on (the NaN's step, a save on the SIGTERM that stopped the attempt, say;
        or, tag "suspect", the onset of a divergence) may hold poisoned weights: move them out of the resume
        path, keeping the data for a person. `cause` says what they were written at or after. Not when not `act`."""
        if not self.act:
            return
        for d in sorted(self.out.glob("checkpoint-*")):
            m = checkpoints.CKPT_RE.fullmatch(d.name) or checkpoints.MERGED_RE.fullmatch(d.name)
            if m and step_of(d) >= from_step:
                target = checkpoints.quarantine_name(d, attempt_n, tag)
                d.rename(target)
                self.seen.pop(str(d), None)
                self.journal.event("quarantine", f"{d.name} was written at or after {cause or f'the NaN at step {from_step}'}: "
                                   f"moved to {target.name}, never resumed from")
        self._repoint_last_checkpoint(from_step)

    def _repoint_last_checkpoint(self, below: int) -> None:
        """ms-swift's last-checkpoint must not name a quarantined step: the relaunch writes a new,
        maybe unfinished, directory of that name, which the stale link would vouch for."""
        link = self.out / "last-checkpoint"
        try:
            if step_of(os.readlink(link)) < below:
                return
        except (OSError, ValueError, IndexError):
            return
        kept = sorted((d for d in self.out.glob("checkpoint-*") if checkpoints.CKPT_RE.fullmatch(d.name)
                       and step_of(str(d)) < below), key=step_of)
        if kept:
            tmp = link.with_name("last-checkpoint.orchestrator-tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(kept[-1].name)
            os.replace(tmp, link)
        else:
            link.unlink()

    def close(self) -> None:
        self.hasher.shutdown(wait=True)  # manifests first: the final sync publishes what they describe
        self.apply_health()


def _mtime(path: str, default: float) -> float:
    """When the trainer finished writing the checkpoint: its newest file (not the directory, whose
    mtime moves when our manifest is written into it)."""
    try:
        return max((os.stat(os.path.join(path, f)).st_mtime for f in manifest.list_files(path)),
                   default=Path(path).stat().st_mtime)
    except OSError:
        return default


def _marker_mtime(path: Path) -> float | None:
    """When the save's completeness marker (megatron's iteration file, swift's trainer_state.json) was written."""
    times = []
    for name in (checkpoints.ITER_FILE, "trainer_state.json"):
        try:
            times.append((path / name).stat().st_mtime_ns)
        except OSError:
            pass
    return max(times, default=None)

