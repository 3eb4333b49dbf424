"""Opening and closing a run, split out of supervisor.py by concern (the same object: Supervisor inherits it).

    PREFLIGHT    placement (drift), the run lock, the journal, the publish lock, the pre-flight checks, a
                 predecessor's trainers stopped, the checkpoint tracker and publisher, the policy history
                 and save intervals rebuilt from the journal, metrics served          -> VERIFYING | COMPLETED
    shutdown     the final attempt recorded, the final sync, the last prune, locks released
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from orchestrator import preflight
from orchestrator.config.recipe import RecipeError, semantic_view
from orchestrator.domain import policy, storage
from orchestrator.host.journal import journal_path
from orchestrator.host.journal_health import open_journal
from orchestrator.preflight import GIB
from orchestrator.save_interval import SaveIntervals
from orchestrator.store.journal_rebuild import rebuild_journal
from orchestrator.store.published import PublishLock
from orchestrator.store.publisher import Publisher
from orchestrator.store.rundir import RunLock, place, run_id, state_dir
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.types import Crash, CrashClass, State


class RunLifecycle:
    def _preflight(self) -> State:
        r = self.recipe
        placement = place(r.run.output_dir, self.hash, semantic_view(r), r.run.on_drift)
        if placement.output_dir != Path(r.run.output_dir):
            r = self.recipe = r.model_copy(update={"run": r.run.model_copy(update={"output_dir": str(placement.output_dir)})})
        self.out = Path(r.run.output_dir)
        self.state_dir = state_dir(self.out)
        self.run_id = run_id(self.out)
        lock = RunLock(self.out)
        lock.acquire()  # raises when another supervisor runs this directory
        self.lock = lock
        self.journal, damaged = open_journal(journal_path(self.state_dir), echo=self.echo, clock=self.host.now)
        rebuilt = rebuild_journal(self.journal, damaged, r, self.hash, self.out, self.state_dir) if damaged else None
        self.publish_lock = PublishLock(r.run.persistent_dir, r.run.name, self.hash, self.out)
        self.publish_lock.acquire()  # raises when another supervisor publishes into this run's directory
        if placement.note:
            self.journal.event("drift", placement.note, keys=list(placement.drifted_keys))
        failed = preflight.stoppers(preflight.checks(r, self.host.gpu_snapshot()))
        if failed:
            raise RecipeError("; ".join(f"pre-flight {c.name}: {c.detail}" for c in failed))
        self._stop_predecessor()
        # the sidecar starts below, after any quarantine, so it never publishes a poisoned checkpoint
        self.sidecar = Publisher(r, self.hash, self.journal, self.metrics)
        self.checkpoints = CheckpointTracker(r, self.hash, self.out, self.journal, self.metrics,
                                             on_saved=self.sidecar.trigger, in_flight=self.sidecar.in_flight)
        previous = self.journal.get_all()
        pending = previous.get("nan_pending")
        if pending:  # the predecessor saw a NaN and was killed before its quarantine; its trainer is stopped now
            self._quarantine(pending["step"], pending["attempt"])
        earlier = self.journal.attempts()
        # attempt numbers continue the journal's (a replaced journal's: after the attempt logs on disk)
        self.attempts_before = max(earlier[-1].n if earlier else 0, rebuilt.attempts_logged if rebuilt else 0)
        self.history = policy.rebuild_history(earlier, {c["step"] for c in self.journal.checkpoints() if c["ok"]})
        budget, _ = preflight.storage_budget(r)
        self.keep_local, self.save_gib = budget.keep_local, sum(budget.per_save_bytes.values()) / GIB
        self.intervals = SaveIntervals(r, self.journal, self.metrics, self.run_id, self.save_gib * GIB,
                                       (budget.step_time_s, budget.step_time_source),
                                       storage.background_bytes(r, budget.per_save_bytes))
        self.metrics.set_info(r.run.name, self.hash, r.run.backend, Path(r.model.path).name)
        if r.metrics.enabled:
            try:
                self.metrics_port = self.metrics.serve(r.metrics.listen)
                self.journal.put(metrics_port=self.metrics_port)
            except OSError as e:  # a taken metrics port must not cost the run; the down alert will show it
                self.journal.event("metrics", f"cannot listen on {r.metrics.listen}: {e}")
        self.journal.put(recipe_hash=self.hash, semantic_view=semantic_view(r), run=r.run.name,
                         backend=r.run.backend, output_dir=str(self.out), supervisor_pid=os.getpid())
        self.sidecar.start()
        self.notifier.ready(f"preflight ok, recipe {self.hash[:12]}")
        if previous.get("state") == State.COMPLETED.value and previous.get("recipe_hash") == self.hash:
            self.journal.event("complete", "this run already completed: nothing to launch (final sync only)")
            return State.COMPLETED
        return State.VERIFYING

    def _stop_predecessor(self) -> None:
        """A supervisor killed with -9 leaves its trainer running: never two trainings on the GPUs."""
        last = self.journal.last_attempt()
        pgids = {last.pid} if last and last.ended_at is None and last.pid and \
            self.host.alive(last.pid, last.pid_start_time) else set()
        leftovers = self.host.leftovers(self.run_id)
        if pgids or leftovers:
            self.journal.event("predecessor", f"stopping {len(leftovers)} process(es) left by an earlier supervisor",
                               pids=leftovers)
            self.host.terminate(self.run_id, pgids, self.recipe.supervisor.grace_s)
        if last and last.ended_at is None:
            self.journal.record_attempt(replace(last, ended_at=self.host.now(), cls=last.cls,
                                                 evidence=("supervisor restarted while this attempt ran",)))

    def _shutdown(self) -> None:
        if not self.sidecar:  # pre-flight did not finish (nothing ran), or already shut down
            if self.lock:
                if self.journal:  # None when the journal could not be opened or moved aside
                    self.journal.close()
                self.lock.release()
                if self.publish_lock:
                    self.publish_lock.release()
                self.publish_lock = None
                self.lock = None
            return
        if self.state is State.COMPLETED and self.attempt and self.attempt.row.ended_at is None:
            self._drain(self.attempt)
            self._finish_attempt(Crash(CrashClass.OTHER), stopped=True)
        if self.state is State.GAVE_UP:
            self.journal.event("gave_up", self.exit_reason)
        self.notifier.stopping(f"{self.state.value}: final sync")  # disarms the watchdog for the final sync
        self.checkpoints.close()  # manifests first: the final sync publishes what they describe
        self.sidecar.stop(final_sync=True)
        self.checkpoints.prune(self.keep_local, pressure=False, writing=False)  # what the final sync published
        self.goodput_at = float("-inf")
        self._pass_done()  # final goodput and sync figures
        if self.state is State.GAVE_UP and self.recipe.metrics.enabled:
            self.host.wait(self.stop_event, self.recipe.metrics.linger_s)  # let Prometheus scrape gave_up
        self.journal.put(state=self.state.value, exit_reason=self.exit_reason, updated_at=self.host.now())
        self.metrics.close()
        self.journal.close()
        self.lock.release()
        self.publish_lock.release()
        self.sidecar = self.lock = self.publish_lock = None

    def _stop(self) -> State:
        a = self.attempt
        self.journal.event("stop", f"stopping: {self.stop_reason}")
        self.host.terminate(self.run_id, {a.launched.pid}, self.recipe.supervisor.grace_s)
        self.host.wait_exit(a.launched, 10)  # the exit status is recorded right after terminate()
        self._drain(a)  # the steps and the checkpoint it wrote on the way out
        self._finish_attempt(Crash(CrashClass.OTHER, (f"stopped by orchestrator: {self.stop_reason}",)), stopped=True)
        return State.STOPPED
