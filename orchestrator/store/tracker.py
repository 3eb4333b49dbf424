"""The run's checkpoints as the supervisor tracks them: each verified once as it appears (the checkpoint_invalid
alert raised at once when bad, cleared when a newer one verifies ok), its manifest hashed and its content checked
off the loop (store/checkpoint_health.py: stale or non-finite weights), its standing moved through the one owner
(store/standing.py: written -> verified -> healthy, or set aside), the local copies of set-aside requests moved,
and the resume point chosen among the healthy ones only."""
from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from orchestrator.store import checkpoint_health, checkpoints, manifest
from orchestrator.domain import retention
from orchestrator.domain.health.kinds import KINDS, Finding
from orchestrator.store.checkpoints import step_of
from orchestrator.store.standing import SetAside, Standings
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.config.recipe import Recipe
from orchestrator.store.sync import InFlight
from orchestrator.types import USABLE, Alert, CheckpointInfo, Resume, Standing


PRUNING = ".orchestrator-pruning-"   # a checkpoint being deleted by retention


class CheckpointTracker:
    def __init__(self, recipe: Recipe, recipe_hash: str, out: Path, journal: Journal, metrics: Metrics,
                 on_saved: Callable[[], None], in_flight: InFlight | None = None, standings: Standings | None = None,
                 act: bool = True):
        """`on_saved`: a healthy checkpoint is ready to publish. `in_flight`: the checkpoint the publisher is
        copying, never pruned or moved. `standings`: the owner of each checkpoint's standing (the run's). `act`
        False (`orchestrator watch`): nothing of the run is renamed or deleted; an unhealthy checkpoint is set aside
        in standing only (never resumed from or published; `run` moves it later) and listed in `left_in_place`."""
        self.recipe, self.hash, self.out, self.act = recipe, recipe_hash, out, act
        self.left_in_place: list[Finding] = []  # act False: what a supervisor would move
        self.in_flight = in_flight or InFlight()
        self.journal, self.metrics, self.on_saved = journal, metrics, on_saved
        self.standings = standings if standings is not None else Standings(journal)
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
        self.checks: dict[str, Future] = {}   # path -> its manifest + content check, submitted, not applied yet
        # (path, step, saved_at, finding or error, manifest unwritten)
        self.checked: list[tuple[str, int, float | None, object, bool]] = []
        self.checked_lock = threading.Lock()
        for left in out.glob(f"{PRUNING}*") if act else ():  # a supervisor killed mid-delete: finish its decision
            shutil.rmtree(left, ignore_errors=True)

    def scan(self, now: float) -> None:
        """Applies finished content checks, then verifies each new complete checkpoint and moves its standing:
        a save the journal already judged (same directory, same newest file time) keeps its standing; a new
        one is written -> verified (its manifest and content check submitted) or invalid."""
        self.apply_checks()
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
            known = self.standings.of(info.step)
            # a set-aside one back under its name with no move pending: a person put it back: judged afresh
            restored = known is not None and known.standing is Standing.SET_ASIDE \
                and self.standings.covering(info.step) is None
            if known is not None and known.path == info.path and known.saved_at == saved and not restored \
                    and known.standing in USABLE | {Standing.SET_ASIDE}:
                if known.standing in USABLE and info.ok:  # judged by an earlier supervisor: its standing says so
                    self.metrics.checkpoint_saved(info.step, saved)
                    self.on_saved()
                continue
            self.standings.move(info.step, info.path, Standing.WRITTEN, saved_at=saved)
            if (req := self.standings.covering(info.step)) is not None:  # the save on the way out of a NaN, say
                self.standings.move(info.step, info.path, Standing.SET_ASIDE, req.reason)
                continue
            if info.ok:
                self.standings.move(info.step, info.path, Standing.VERIFIED)
                self.metrics.checkpoint_saved(info.step, saved)
                self.journal.event("checkpoint", f"verified {Path(info.path).name}")
                self._check(info.path, info.step, info.loss, saved)
            else:
                self.standings.move(info.step, info.path, Standing.INVALID)
                self.metrics.checkpoint_invalid()
                self.journal.event("checkpoint_invalid", f"{Path(info.path).name}: " + "; ".join(info.problems))

    def _check(self, path: str, step: int, loss: float | None, saved: float | None) -> None:
        """The manifest (unless a current one is there) and the content check, off the loop: hashing a large
        checkpoint takes minutes. A manifest that fails (a full disk refuses even a small JSON) is retried by
        retry_manifests(), and the content check runs all the same (on the hashes in memory): a manifest proves
        bytes, not health, and a full disk must not cost the run its resume point."""
        def job() -> tuple[object, bool]:
            m, unwritten = manifest.read_manifest(path), False
            if m is None or manifest.manifest_stale(path, m):
                m = manifest.build_manifest(path, step, self.hash, loss)  # OSError: the files went meanwhile
                try:
                    manifest.write_json_atomic(Path(path) / manifest.MANIFEST, m)
                except OSError:
                    unwritten = True
            try:
                return self.health.check(path, step, m), unwritten
            except Exception as e:  # a bug in a check must not cost the run: said, and the checkpoint stays usable
                return RuntimeError(f"content check failed: {type(e).__name__}: {e}"), unwritten

        def done(f: Future) -> None:
            err = f.exception()
            with self.checked_lock:
                self.checked.append((path, step, saved, *((err, False) if err is not None else f.result())))
        self.unhashed.pop(path, None)
        fut = self.hasher.submit(job)
        self.checks[path] = fut
        fut.add_done_callback(done)

    def pending_checks(self) -> list[Future]:
        """The content checks submitted and not applied yet (the relaunch awaits them, bounded)."""
        return list(self.checks.values())

    def wait_checks(self, timeout_s: float | None = None) -> bool:
        """Waits for the submitted content checks (at most `timeout_s`) and applies them; True when none is left."""
        futures.wait(self.pending_checks(), timeout=timeout_s)
        self.apply_checks()
        return not self.checks

    def apply_checks(self) -> None:
        """Moves each checked checkpoint's standing (the loop's thread): healthy (and the publisher woken), or,
        for a finding (checkpoint_unchanged, checkpoint_nonfinite), set aside by a durable request, recorded not
        ok, the checkpoint_invalid alert raised when it is the newest, the event journaled with its numbers. A
        check about a save that has since been replaced or set aside changes nothing."""
        with self.checked_lock:
            done, self.checked = self.checked, []
        for path, step, saved, result, unwritten in done:
            self.checks.pop(path, None)
            e = self.standings.of(step)
            if unwritten or isinstance(result, OSError):  # the manifest is retried (retry_manifests)
                self.unhashed[path] = (step, None)
            if e is None or e.path != path or e.saved_at != saved or e.standing is not Standing.VERIFIED:
                continue
            if isinstance(result, OSError):   # its files could not be read: the standing waits for the retry
                continue
            if isinstance(result, Finding):
                self._found(result)
                continue
            if isinstance(result, BaseException):
                self.journal.event("checkpoint_check_failed", f"{Path(path).name}: {result}; kept as healthy")
            self.standings.move(step, path, Standing.HEALTHY)
            self.on_saved()

    def _found(self, f: Finding) -> None:
        """A content finding: the checkpoint is set aside (standing first, then its copies), said with its numbers."""
        reason, step, path = KINDS[f.kind].sets_aside, f.last_step, f.subject
        assert reason is not None and step is not None and path is not None, f
        self.standings.request(SetAside(step, reason, 0, f.message, only_step=True))
        self.seen.pop(path, None)
        self.journal.record_checkpoint(step, path, False, (f.message,), None, self.hash)
        self._verdict(step, False, (f.message,))
        self.metrics.checkpoint_invalid()
        if self.act:
            self.journal.event(f.kind, f"{f.message}; set aside as {Path(path).name}.{reason.tag}", **f.details)
        else:
            self.left_in_place.append(f)
            self.journal.event(f.kind, f"{f.message}; left in place (watch mode)", **f.details)
        self.metrics.health_event(f.kind)

    def set_aside_local(self, req: SetAside, busy: frozenset[str] = frozenset()) -> bool:
        """Moves the local checkpoints (and merged copies) `req` covers out of the checkpoint-N namespace, keeping
        the data for a person; one the publisher is copying, or one a live trainer was launched from (`busy`),
        waits. Returns True when every one has moved (the request's local part is then done)."""
        waiting, top = False, req.from_step
        for d in sorted(self.out.glob("checkpoint-*")):
            ckpt = checkpoints.CKPT_RE.fullmatch(d.name)
            if not (ckpt or checkpoints.MERGED_RE.fullmatch(d.name)) or not req.covers(s := step_of(d)):
                continue
            top = max(top, s)
            with self.in_flight.lock:
                if str(d) in busy or self.in_flight.path in (str(d), str(d).removesuffix("-merged")):
                    waiting = True
                    continue
                target = (checkpoint_health.unhealthy_name(d, req.reason.tag) if req.only_step
                          else checkpoints.quarantine_name(d, req.attempt, req.reason.tag))
                try:
                    d.rename(target)
                except OSError as e:  # retried by the next call; the standing already keeps it out of use
                    self.journal.event("quarantine", f"{d.name}: not moved yet: {e.strerror or e}; retried")
                    waiting = True
                    continue
            self.seen.pop(str(d), None)
            if ckpt:
                self.standings.set_aside_known(s, str(d), req.reason)
            self.journal.event("quarantine", f"{d.name}: {req.cause.removeprefix(f'{d.name}: ')}: moved to "
                               f"{target.name}, never resumed from", reason=req.reason.value, step=s)
        if waiting:
            return False
        self._repoint_last_checkpoint(req.from_step, only=req.from_step if req.only_step else None)
        self.standings.progressed(req, local_through=top)
        return True

    def retry_manifests(self) -> None:
        for path, (step, loss) in list(self.unhashed.items()):
            if os.path.isdir(path):
                self._check(path, step, loss, e.saved_at if (e := self.standings.of(step)) is not None else None)
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
        """The newest good step (no later than `through`; see good_steps), -1 if none."""
        return max((s for s in self.good_steps() if through is None or s <= through), default=-1)

    def good_steps(self) -> list[int]:
        """Every step verified and not set aside (healthy, or its content check still running), oldest first:
        where a rollback can go; the relaunch then takes the newest healthy one (resume_point)."""
        return sorted(s for p, ok in self.seen.items() if ok and (s := step_of(p)) is not None
                      and (e := self.standings.of(s)) is not None and e.path == p
                      and e.standing in USABLE | {Standing.VERIFIED})

    def forget_after(self, step: int) -> None:
        """A new attempt rewrites every checkpoint after its resume point, in place: until a rewrite's
        completeness marker is newer than now, such a directory still holds the old save (complete-looking
        while half rewritten), so it is not verified; once rewritten, it is verified afresh."""
        self.seen = {p: ok for p, ok in self.seen.items() if step_of(p) <= step}
        self.stale = {str(d): _marker_mtime(d) for d in self.out.glob("checkpoint-*")
                      if checkpoints.CKPT_RE.fullmatch(d.name) and step_of(str(d)) > step}

    def resume_point(self) -> Resume | None:
        """The newest checkpoint that verifies, was written by this recipe and stands healthy (or published);
        each newer one passed over is journaled (resume_skip) with why."""
        best = None
        for info in checkpoints.scan(self.out, self.recipe.run.backend, self.expect, newest_first=True):
            best, passed = checkpoints.pick_resume([info], {info.path: manifest.read_manifest(info.path)},
                                                   self.hash, require_manifest=False)
            if best is not None and not self.standings.usable(info.step, info.path):
                e = self.standings.of(info.step)
                passed, best = [f"{Path(info.path).name}: standing {e.standing.value if e else 'unknown'}: "
                                "not health-checked as healthy"], None
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
        self.apply_checks()  # what finished checking since the last scan counts (a wait for space scans nothing)
        kv = self.journal.get_all()
        if (kv.get("nan_pending") or {}).get("step") is not None or any(not p.local_done for p in self.standings.pending):
            return 0  # a NaN seen or checkpoints to set aside, not moved yet: keep all
        synced = {c["step"] for c in self.journal.checkpoints() if c["ok"] and c["synced_at"]}
        merged_synced = set(kv.get("merged_synced") or ())  # publisher.report keeps it
        newest = self.newest_good_step(trusted_through)
        torn = [] if writing else [retention.Local(i.step, i.path, False, False, False) for i in checkpoints.scan(
            self.out, self.recipe.run.backend, self.expect, skip=self.seen.keys()) if not i.complete]
        doomed = []
        with self.in_flight.lock:  # decided and renamed before the publisher can take one of them
            # the publisher copies only the newest: an older unpublished one never will be (superseded)
            local = [retention.Local(s, p, True, self.standings.usable(s, p) and s <= newest, s in synced, p + "-merged" if
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

    def _repoint_last_checkpoint(self, below: int, only: int | None = None) -> None:
        """ms-swift's last-checkpoint must not name a set-aside step (from `below` on; `only`: that step alone):
        the relaunch writes a new, maybe unfinished, directory of that name, which the stale link would vouch for."""
        link = self.out / "last-checkpoint"
        try:
            named = step_of(os.readlink(link))
            if named < below or (only is not None and named != only):
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

    def close(self, move: bool = True) -> None:
        """Finishes the manifests and content checks and applies them; `move`: and moves the local copies the
        pending set-asides name (a tool's tracker; the supervisor moves them itself, minding a live trainer)."""
        self.hasher.shutdown(wait=True)  # manifests and checks first: the final sync publishes the healthy ones
        self.apply_checks()
        for req in list(self.standings.pending) if self.act and move else ():
            if not req.local_done:
                self.set_aside_local(req)


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

