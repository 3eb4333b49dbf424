"""The run's context: everything PREFLIGHT opens, in one object with no optional parts, closed by the shutdown.

    open_run   placement (drift), the run lock, the journal (a damaged one moved aside and rebuilt from the
               disk), the publish lock, the pre-flight checks, a
               predecessor's trainers stopped, the checkpoint standings, the publisher and the checkpoint tracker,
               the set-asides the predecessor left pending, the policy history and save intervals rebuilt from the journal,
               metrics served, the publisher started
    close      the final sync, the last prune, the final record, locks released

A failure while opening (a stopping check, a held lock) releases what was opened so far and raises.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.config.recipe import Recipe, RecipeError, semantic_view
from orchestrator.domain import policy, storage
from orchestrator.host.base import Host
from orchestrator.host.journal import Journal, journal_path
from orchestrator.host.journal_health import open_journal
from orchestrator.host.metrics import Metrics
from orchestrator.loop import preflight
from orchestrator.loop.save_interval import SaveIntervals
from orchestrator.store.journal_rebuild import rebuild_journal
from orchestrator.store.published import PublishLock
from orchestrator.store.publisher import Publisher
from orchestrator.store.rundir import RunLock, place, run_id, state_dir
from orchestrator.store.standing import SetAside, Standings
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.types import GIB, CrashClass, SetAsideReason, State


@dataclass
class RunContext:
    """What a supervised run holds open between PREFLIGHT and the shutdown."""

    recipe: Recipe                  # as placed: output_dir may be a drifted run's new directory
    out: Path
    state_dir: Path
    run_id: str
    lock: RunLock
    journal: Journal
    publish_lock: PublishLock
    publisher: Publisher
    checkpoints: CheckpointTracker
    standings: Standings            # the one owner of each checkpoint's standing (store/standing.py)
    intervals: SaveIntervals
    history: policy.History         # the crash policy's memory, rebuilt from the journal
    attempts_before: int            # attempt numbers continue the journal's
    keep_local: int
    save_gib: float
    metrics_port: int | None        # None: metrics disabled, or their port was taken
    completed_before: bool          # an earlier supervisor completed this recipe: nothing to launch
    acting: bool = True             # False (`orchestrator watch`): set-asides are recorded, never moved
    closed: bool = False

    def set_aside(self, from_step: int, reason: SetAsideReason, attempt_n: int, cause: str) -> None:
        """Sets aside the checkpoints from `from_step` on: the request durably first (their standing changes at
        once: no round publishes them, no resume takes them), then the copies moved (apply_set_asides). Called
        once the trainer has stopped."""
        self.standings.request(SetAside(from_step, reason, attempt_n, cause))
        self.apply_set_asides()

    def apply_set_asides(self, busy: frozenset[str] | None = None, local: bool = True, wait_s: float = 0.0) -> bool:
        """Moves what the pending set-aside requests still name, local copies first (no round can republish one),
        then the published ones (the sync lock waited for at most `wait_s`: a request the lock refuses is retried
        on a later call). `busy`: a trainer is alive, launched from these directories: a checkpoint range waits for
        it to stop and its launch directory is never renamed; `local` False: published copies only. A request is
        cleared when both parts are done, and a NaN's `nan_pending` with the last NaN request. Not `acting`
        (watch mode): nothing moves. Returns True when no request is left."""
        st = self.standings
        had_nan = self.acting and any(p.reason is SetAsideReason.NAN for p in st.pending)
        for req in list(st.pending) if self.acting else ():
            if local and not req.local_done and (busy is None or req.only_step):
                self.checkpoints.set_aside_local(req, busy or frozenset())
            now = st.current(req)
            if now is not None and now.local_done and not now.published_done \
                    and self.publisher.set_aside_published(now, wait_s):
                st.progressed(now, published=True)
        if had_nan and not any(p.reason is SetAsideReason.NAN for p in st.pending):
            self.journal.put(nan_pending=None)
        return not st.pending

    def release(self) -> None:
        """Closes the journal and releases the locks (the last step of close, and of a failed open)."""
        self.journal.close()
        self.lock.release()
        self.publish_lock.release()
        self.closed = True


def open_run(recipe: Recipe, hash_: str, host: Host, metrics: Metrics,
             echo: Callable[[str], None] | None = None, act: bool = True) -> RunContext:
    """Opens a run for supervision (see the module docstring); raises RecipeError on a stopping pre-flight
    check, and the lock's error when another supervisor holds this run. `act` False (`orchestrator watch` of a
    trainer started by hand): the run stays in output_dir whatever the drift (the trainer writes there), no
    pre-flight check stops it (the trainer holds the GPUs and the port), nothing is stopped, renamed or deleted
    (an open attempt row is closed, its trainer left alone; a pending NaN waits for `run`)."""
    r = recipe
    placement = place(r.run.output_dir, hash_, semantic_view(r), r.run.on_drift if act else "resume")
    if placement.output_dir != Path(r.run.output_dir):
        r = r.model_copy(update={"run": r.run.model_copy(update={"output_dir": str(placement.output_dir)})})
    out = Path(r.run.output_dir)
    with ExitStack() as opened:
        lock = RunLock(out)
        lock.acquire()  # raises when another supervisor runs this directory
        opened.callback(lock.release)
        # a damaged journal is moved aside and a new one rebuilt from the disk (journal_replaced)
        journal, damaged = open_journal(journal_path(state_dir(out)), echo=echo, clock=host.now)
        opened.callback(journal.close)
        rebuilt = rebuild_journal(journal, damaged, r, hash_, out, state_dir(out)) if damaged else None
        publish_lock = PublishLock(r.run.persistent_dir, r.run.name, hash_, out)
        publish_lock.acquire()  # raises when another supervisor publishes into this run's directory
        opened.callback(publish_lock.release)
        if placement.note:
            journal.event("drift", placement.note, keys=list(placement.drifted_keys))
        failed = preflight.stoppers(preflight.checks(r, host.gpu_snapshot())) if act else []
        if failed:
            raise RecipeError("; ".join(f"pre-flight {c.name}: {c.detail}" for c in failed))
        _stop_predecessor(r, host, journal, run_id(out), act)
        # the publisher starts at the end, after any quarantine, so it never publishes a poisoned checkpoint
        standings = Standings(journal)
        publisher = Publisher(r, hash_, journal, metrics, standings)
        checkpoints = CheckpointTracker(r, hash_, out, journal, metrics, on_saved=publisher.trigger,
                                        in_flight=publisher.in_flight, standings=standings, act=act)
        previous = journal.get_all()
        earlier = journal.attempts()
        budget, _ = preflight.storage_budget(r)
        save_gib = sum(budget.per_save_bytes.values()) / GIB
        ctx = RunContext(
            recipe=r, out=out, state_dir=state_dir(out), run_id=run_id(out), lock=lock, journal=journal,
            publish_lock=publish_lock, publisher=publisher, checkpoints=checkpoints, standings=standings, acting=act,
            intervals=SaveIntervals(r, journal, metrics, run_id(out), save_gib * GIB,
                                    (budget.step_time_s, budget.step_time_source),
                                    storage.background_bytes(r, budget.per_save_bytes)),
            history=policy.rebuild_history(earlier, {c["step"] for c in journal.checkpoints() if c["ok"]}),
            # attempt numbers continue the journal's (a replaced journal's: after the attempt logs on disk)
            attempts_before=max(earlier[-1].n if earlier else 0, rebuilt.attempts_logged if rebuilt else 0),
            keep_local=budget.keep_local, save_gib=save_gib,
            metrics_port=None, completed_before=(previous.get("state") == State.COMPLETED.value
                                                 and previous.get("recipe_hash") == hash_))
        pending = previous.get("nan_pending")
        if pending and not any(p.reason is SetAsideReason.NAN for p in standings.pending):
            # killed between recording the NaN and its request (or an earlier release's journal): request it now
            standings.request(SetAside(pending["step"], SetAsideReason.NAN, pending["attempt"],
                                       f"written at or after the NaN at step {pending['step']}"))
        ctx.apply_set_asides()  # what a predecessor requested: its trainer is stopped now (watch: left for `run`)
        metrics.set_info(r.run.name, hash_, r.run.backend, Path(r.model.path).name)
        if r.metrics.enabled:
            try:
                ctx.metrics_port = metrics.serve(r.metrics.listen)
                journal.put(metrics_port=ctx.metrics_port)
            except OSError as e:  # a taken metrics port must not cost the run; the down alert will show it
                journal.event("metrics", f"cannot listen on {r.metrics.listen}: {e}")
        journal.put(recipe_hash=hash_, semantic_view=semantic_view(r), run=r.run.name,
                    backend=r.run.backend, output_dir=str(out), supervisor_pid=os.getpid())
        publisher.start()
        opened.pop_all()  # open: the shutdown closes it from here on
    return ctx


def _stop_predecessor(r: Recipe, host: Host, journal: Journal, run: str, act: bool = True) -> None:
    """Stops the trainer a supervisor killed with -9 left running (never two trainings on the GPUs) and closes
    the attempt row it left open (not `act`: only closes the row)."""
    last = journal.last_attempt()
    if not act:
        if last and last.ended_at is None:
            journal.record_attempt(replace(last, ended_at=host.now(), evidence=(
                "a supervisor or watcher ended while this attempt ran",)))
        return
    pgids = {last.pid} if last and last.ended_at is None and last.pid and \
        host.alive(last.pid, last.pid_start_time) else set()
    leftovers = host.leftovers(run)
    if pgids or leftovers:
        journal.event("predecessor", f"stopping {len(leftovers)} process(es) left by an earlier supervisor",
                      pids=leftovers)
        host.terminate(run, pgids, r.supervisor.grace_s)
    if last and last.ended_at is None:
        # a NaN its supervisor saw before it was killed still counts (nan_loss twice gives up): nan_pending says so
        nan = (journal.get_all().get("nan_pending") or {}).get("attempt") == last.n
        journal.record_attempt(replace(last, ended_at=host.now(), cls=CrashClass.NAN_LOSS if nan else last.cls,
                                       evidence=("supervisor restarted while this attempt ran",)
                                       + (("a NaN/Inf was logged (nan_pending)",) if nan else ())))
