"""The checkpoint gate's fault matrix (issue 31, item 7): {non-finite save, stale save, NaN, loss over the limit,
divergence} x {the trainer killed right after the save, a sync round before the tracker, a round in flight, the
supervisor killed with -9, the sync lock held for minutes} x {local, published}: 50 cells on the in-memory host
with real checkpoint directories, a real journal and real sync rounds.

In every cell checkpoint-24 is the bad one (or the first saved past the onset), checkpoint-20 the newest healthy
one. Invariant, once the run has relaunched: no checkpoint that is not healthy is the resume point, the newest
published copy or what an export would merge (the export merges resume_point()'s), and the journal says what was
done with checkpoint-24. "published": the checkpoint had every chance to reach persistent storage before its fault
was known (a round after its save; a log fault read only after that round).
"""
from __future__ import annotations

import pytest

from checkpoint_dirs import make_megatron
from gate_world import (NAN_LINE, N, a_pass, events, poison, publish_now, published_steps, resumed_from, stale_copy,
                        train_to, world_with)
from loop_world import OOM, drive, journal, running
from orchestrator.store import sync
from orchestrator.store.publisher import Publisher
from orchestrator.store.published import publish_dir
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.types import USABLE, State

FAULTS = ("nonfinite", "stale", "nan", "loss_limit", "divergence")
MOMENTS = ("killed_after_save", "round_before_tracker", "round_in_flight", "supervisor_killed", "lock_held")
COPIES = ("local", "published")
HEALTH = {  # what each fault needs of run health; the rest keep the defaults
    "loss_limit": {"loss_max": 10.0, "on_divergence": "rollback"},
    "divergence": {"divergence_window": 3, "on_divergence": "rollback"},
}
CONTENT = frozenset({"nonfinite", "stale"})   # in the checkpoint's bytes; the rest in the log


def save_24(sup, fault: str) -> None:
    """Writes checkpoint-24 as the fault has it: poisoned bytes, a stale copy, or (log faults) ordinary bytes."""
    out = sup.ctx.out
    if fault == "nonfinite":
        poison(make_megatron(out, 24))
    elif fault == "stale":
        stale_copy(out, 20, 24)
    else:
        make_megatron(out, 24)


def log_fault(t, fault: str) -> None:
    """The steps up to 25 as the trainer logged them: the fault's lines for a log fault, ordinary ones else."""
    if fault == "nan":
        t.steps(22, 23, N)
        t.write(NAN_LINE % 24)
    elif fault == "loss_limit":
        t.steps(22, 25, N, loss=50.0)
    elif fault == "divergence":
        t.steps(22, 30, N, loss=4.0)
    else:
        t.steps(22, 25, N)


def exit_trainer(t) -> None:
    t.write(OOM)
    t.exit(code=1)


def relaunched(sup, host, limit: int = 40):
    """Steps the supervisor until it runs a new attempt; returns that trainer."""
    before = len(host.trainers)
    for _ in range(limit):
        if sup.state is State.RUNNING and len(host.trainers) > before:
            return host.trainers[-1]
        assert sup.state not in (State.GAVE_UP, State.STOPPED, State.COMPLETED), sup.exit_reason
        sup.step()
    raise AssertionError(f"no relaunch; stuck in {sup.state.value}")


def check_invariant(sup, host, fault: str, copy: str) -> None:
    out = sup.ctx.out
    t = host.trainers[-1]
    resume = sup.ctx.checkpoints.resume_point()
    assert resume is not None and resume.step <= 20, resume
    assert resumed_from(t) == str(out / f"checkpoint-{resume.step}")
    standing = sup.ctx.standings.of(resume.step)
    assert standing is not None and standing.standing in USABLE
    assert not (out / "checkpoint-24").exists() or sup.ctx.standings.of(24).standing not in USABLE
    if sup.ctx.recipe.run.persistent_dir:
        assert all(s < 24 for s in published_steps(sup)), published_steps(sup)
    said = [e for e in journal(sup).events(2000) if "checkpoint-24" in e["message"]
            and e["kind"] in ("quarantine", "checkpoint_nonfinite", "checkpoint_unchanged")]
    assert said, "the journal says what was done with checkpoint-24"


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("fault", FAULTS)
def test_no_unhealthy_checkpoint_is_resumed_published_or_merged(world, tmp_path, monkeypatch, fault, moment, copy):
    sup, host = world_with(world, persistent=tmp_path / "pers", health=HEALTH.get(fault, {}))
    t = running(sup, host)
    train_to(sup, host, t, 21)
    pub = publish_dir(sup.ctx.recipe.run.persistent_dir, sup.ctx.recipe.run.name, sup.hash)
    save_24(sup, fault)
    lock_fd = None
    if moment == "round_before_tracker" or copy == "published":
        publish_now(sup)   # a round reaches checkpoint-24 before the tracker has scanned it
    if copy == "published":
        a_pass(sup, host)   # scanned; its content check ...
        sup.ctx.checkpoints.wait_checks(60)   # ... done: healthy bytes are published now
        publish_now(sup)
    if moment == "round_in_flight":
        assert sup.ctx.publisher.in_flight.take(str(sup.ctx.out / "checkpoint-24"))   # a round copying it
        waits: list[float] = []
        host.on_wait = lambda h, s: waits.append(s) if len(waits) < 5 else sup.ctx.publisher.in_flight.release()
    if moment == "lock_held":
        lock_fd = sync.open_lock(pub, wait_s=60)   # a round holding the lock for minutes
    if moment == "supervisor_killed":  # killed after the finding was recorded, before anything moved
        monkeypatch.setattr(CheckpointTracker, "set_aside_local", lambda self, req, busy=frozenset(): False)
        monkeypatch.setattr(Publisher, "set_aside_published", lambda self, req, wait_s=0.0: False)
    log_fault(t, fault)
    if moment != "supervisor_killed" or fault in CONTENT:
        exit_trainer(t)   # killed right after the save (or, a log fault, found in the same pass)
    try:
        if moment == "supervisor_killed":
            for _ in range(20):
                a_pass(sup, host) if sup.state is State.RUNNING else sup.step()
                if sup.ctx.standings.pending:
                    break
            assert sup.ctx.standings.pending, "the finding is recorded before any move"
            old = sup.ctx.publisher.thread   # kill -9: its threads die with it (a copy it ran is cancelled) ...
            assert old is not None
            old.stop(timeout=60, cancel=True)
            assert not old.is_alive()
            sup.ctx.release()   # ... no shutdown; the locks go with the process
            sup.ctx.closed = True
            monkeypatch.undo()
            sup, host = world_with(world, persistent=tmp_path / "pers", health=HEALTH.get(fault, {}))
            drive(sup, State.RUNNING)
        else:
            relaunched(sup, host)
        if moment == "lock_held":
            if copy == "published" and fault not in CONTENT:   # a copy of 24 is out there: it waits for the lock
                assert sup.ctx.standings.pending, "held: the published part waits, recorded"
            else:   # the gate kept 24 from persistent storage: nothing to move, no lock needed
                assert not sup.ctx.standings.pending
            assert sup.ctx.standings.publish_refusal(24, str(sup.ctx.out / "checkpoint-24")) is not None
            sync.os.close(lock_fd)
            lock_fd = None
            a_pass(sup, host)   # the next pass's housekeeping moves the published copies
    finally:
        if lock_fd is not None:
            sync.os.close(lock_fd)
    check_invariant(sup, host, fault, copy)
    thread = sup.ctx.publisher.thread
    for _ in range(20):   # the supervisor's own sync thread may hold the lock for a round: retried every pass
        if not sup.ctx.standings.pending:
            break
        assert thread is not None and thread.wait_rounds(thread.rounds + 1, timeout=30)
        a_pass(sup, host)
    assert not sup.ctx.standings.pending, [p.to_json() for p in sup.ctx.standings.pending]
    assert not journal(sup).get_all().get("nan_pending")


def test_the_matrix_has_fifty_cells():
    assert len(FAULTS) * len(MOMENTS) * len(COPIES) == 50
    assert events  # the shared helpers are the ones the regression tests use
