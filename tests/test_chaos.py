"""Chaos soak (tests/support/chaos.py): injected faults of every crash class, kill -9 of the supervisor at awkward
moments and interrupted syncs, with the reliability invariants checked all along.

CI runs the small counts (about 25 faults, 3 supervisor kills, 3 standalone sync kills; well under 90 s on
two cores). ORCH_CHAOS_FULL=1 runs the full soak (200 faults, 20 + 20 kills); ORCH_CHAOS_SEED=N replays a seed.
"""
from __future__ import annotations

import fcntl
import os
import random
import threading

import pytest

import chaos
from chaos import C, SAVE, Config, plan_soak, soak
from orchestrator.types import CrashClass, ExitCode
from supervised import attempts, fake_recipe, published_at, supervise, wait_for

FULL = os.environ.get("ORCH_CHAOS_FULL") == "1"


def _seed() -> int:
    s = os.environ.get("ORCH_CHAOS_SEED")
    return int(s) if s else random.SystemRandom().randrange(1 << 31)


class _Killed(BaseException):
    """Stands for SIGKILL of the supervisor at a chosen line (raised from a patched method)."""


@pytest.mark.chaos
def test_chaos_soak(tmp_path):
    seed = _seed()
    cfg = Config.full(seed) if FULL else Config.ci(seed)
    rep = soak(cfg, tmp_path)
    table = rep.table()
    print(table)
    why = f"chaos soak failed with seed {seed} (replay: ORCH_CHAOS_SEED={seed}); runs in {tmp_path}\n{table}"
    assert not rep.violations, why
    assert rep.faults_injected >= cfg.faults + cfg.other_runs, why
    every = {c.value for c in CrashClass}
    assert rep.injected_classes == every, why
    # every class classified as injected (a class whose every fault hit an attempt ended by a kill aside)
    assert set(rep.classes) | set(rep.excused) == every, why
    kills = rep.supervisor_kills
    assert len(kills) >= cfg.supervisor_kills, why
    # a kill ends at most the attempt it interrupted and one its predecessor never recorded
    assert rep.faults_injected - rep.faults_classified <= 2 * len(kills), why
    assert all(r.max_trainers <= 1 and r.samples >= 5 * r.duration_s for r in rep.runs), why  # sampled often
    if rep.rsync:  # copies are slowed by an rsync --bwlimit wrapper: the staging windows are real
        assert {"sync", "attempt_row", "launching"} <= {k.kind for k in kills} or cfg.supervisor_kills < 3, why
        assert any(k.kind == "sync" and k.partial and k.copying for k in kills) or cfg.supervisor_kills < 1, why
        assert len(rep.sync_kills) >= cfg.sync_kills, why
        assert rep.interrupted_syncs >= cfg.sync_kills, why
        assert all(r.partial_samples for r in rep.runs if r.plan.expect_exit == ExitCode.OK), why


@pytest.mark.parametrize("make", [Config.ci, Config.full], ids=["ci", "full"])
@pytest.mark.parametrize("seed", range(25))
def test_plans_keep_every_relaunch_making_progress(seed, make):
    """The fault layout the soak relies on: clusters at c+1 after a checkpoint step c, the primary first and
    mid-training, at most one follower per cluster counted by the no-progress guard, none after disk_full,
    one nan_loss per run with NAN_GAP save intervals after it, every class in every long run."""
    for plan in plan_soak(make(seed)):
        steps = sorted({f.step for f in plan.faults})
        if plan.expect_exit == ExitCode.GAVE_UP:
            assert plan.faults[-1].cls is C.OTHER
            continue
        assert {f.cls for f in plan.faults} == set(CrashClass) - {C.OTHER}, plan.name
        assert all(s % SAVE == 1 for s in steps) and steps[0] > SAVE and plan.iterations >= steps[-1] + SAVE
        for s in steps:
            cl = [f for f in plan.faults if f.step == s]
            assert cl[0].role in ("primary", "nan") and all(f.role == "follower" for f in cl[1:])
            assert len({f.cls for f in cl}) == len(cl), "one key per class and step"
            assert sum(f.cls is not C.PORT_IN_USE for f in cl[1:]) <= 1
            assert cl[0].cls is not C.DISK_FULL or len(cl) == 1
            assert not any(f.cls in (C.COLD_START_OOM, C.PORT_IN_USE) for f in cl[:1])
        nan = [f for f in plan.faults if f.cls is C.NAN_LOSS]
        assert len(nan) == 1 and all(f.step == nan[0].step or abs(f.step - nan[0].step) >= chaos.NAN_GAP * SAVE
                                     for f in plan.faults if f.step > nan[0].step)
        assert all(SAVE <= e.arm_step < steps[-1] for e in plan.events)


def test_nan_then_crash_resumes_from_the_newest_checkpoint(tmp_path):
    """Found by the soak: a NaN used to exclude every later checkpoint for the rest of the run."""
    recipe = fake_recipe(tmp_path, iterations=60, faults="nan_loss@15,fla_backward_oom@45",
                         supervisor={"max_crashes_per_hour": 100})
    code, _ = supervise(recipe)
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [a.cls for a in runs] == [CrashClass.NAN_LOSS, CrashClass.FLA_BACKWARD_OOM, None]
    assert runs[1].start_step == 10, "the NaN attempt's own checkpoints are skipped"
    assert runs[2].start_step == 40, f"resumed from {runs[2].resumed_from} after a crash at step 45"


def test_nan_logged_just_before_a_crash_is_not_resumed_past(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=40, faults="nan_loss@15,fla_backward_oom@25",
                         supervisor={"poll_s": 5.0, "max_crashes_per_hour": 100})  # the exit wakes it
    code, _ = supervise(recipe)
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert runs[0].end_step >= 20, "checkpoint-20 was saved after the NaN"
    assert runs[1].start_step == 10, f"resumed from {runs[1].resumed_from}, saved after the NaN at 15"


def test_nan_quarantine_survives_a_supervisor_killed_before_it(tmp_path, monkeypatch):
    from orchestrator.config.recipe import load
    from orchestrator.store.tracker import CheckpointTracker
    from orchestrator.loop.supervisor import Supervisor

    recipe = fake_recipe(tmp_path, iterations=200, faults="nan_loss@19", supervisor={"poll_s": 0.5})

    def killed(self, *args):
        raise _Killed()

    monkeypatch.setattr(CheckpointTracker, "set_aside_local", killed)   # killed after the request, before a move
    with pytest.raises(_Killed):
        Supervisor(load(recipe), install_signals=False).run()
    monkeypatch.undo()
    runs = attempts(tmp_path / "out")
    assert runs[0].cls is CrashClass.NAN_LOSS and runs[0].end_step >= 20, "checkpoint-20 holds NaN weights"
    code, _ = supervise(recipe)
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert runs[1].start_step == 10, f"resumed from {runs[1].resumed_from}, saved after the NaN at 19"


def test_trainer_started_by_a_killed_supervisor_gets_its_own_attempt_row(tmp_path, monkeypatch):
    """Found by the soak: a supervisor killed between starting the trainer and writing its row left an orphan
    whose output its successor appended to the log of an attempt with the same number (a start-up
    cold_start_oom was classified oom_during_training from the orphan's steps)."""
    from orchestrator.host.launch import local as launcher
    from orchestrator.config.recipe import load
    from orchestrator.loop.supervisor import Supervisor

    recipe = fake_recipe(tmp_path, iterations=40, faults="fla_backward_oom@15,cold_start_oom@21",
                         extra_env={"FAKE_STEP_S": "0.02"})
    real, started = launcher.launch, []

    def launch_then_die(*a, **k):
        started.append(real(*a, **k))
        if len(started) == 2:  # the relaunch after the fla OOM: the trainer runs, no row is written
            raise _Killed()
        return started[-1]

    monkeypatch.setattr(launcher, "launch", launch_then_die)
    with pytest.raises(_Killed):
        Supervisor(load(recipe), install_signals=False).run()
    monkeypatch.undo()
    orphan = started[1]
    # The orphan trains on, reaches checkpoint-20 and fires cold_start_oom@21 mid-training itself, as it
    # did in the soak. Whether it is still running now is a race (0.2 s of steps), so ask how it ended:
    # by its own fault, not by a signal from the dying supervisor.
    assert orphan.exited.wait(60)
    assert orphan.status.signal is None and orphan.status.code == 1, f"the orphan was stopped: {orphan.status}"
    assert "checkpoint-20" in chaos.attempt_log(str(orphan.log_path))[0], "the orphan kept training to step 21"
    code, _ = supervise(recipe)
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    logs = [chaos.attempt_log(a.log_path)[1] for a in runs]
    assert logs == [1] * len(runs), f"trainers per attempt log: {logs}"
    assert len(runs) == 3 and "supervisor restarted" in " ".join(runs[1].evidence), \
        "the orphan has a row (ended by the successor), the successor's attempt comes after it"


def test_final_sync_waits_for_a_sync_lock_held_briefly(tmp_path, monkeypatch):
    from orchestrator.store import sync

    recipe = fake_recipe(tmp_path, iterations=30)
    final = tmp_path / "out" / "checkpoint-30" / "latest_checkpointed_iteration.txt"
    lock = published_at(recipe) / ".orchestrator-sync.lock"
    held, final_round, lock_held_at_final_round = threading.Event(), threading.Event(), []
    real_open_lock = sync.open_lock

    def open_lock(persistent, wait_s=0.0):
        if wait_s > 0:  # the final round, the only one that waits for the lock
            assert held.wait(60), "the holder never got the lock"  # the scenario's order, not a race
            probe = os.open(lock, os.O_RDWR)
            try:
                lock_held_at_final_round.append(not _try_flock(probe))
            finally:
                os.close(probe)
            final_round.set()
        return real_open_lock(persistent, wait_s)

    monkeypatch.setattr(sync, "open_lock", open_lock)

    def hold_like_an_orphaned_rsync():  # the lock from the final save until the final sync is waiting for it
        assert wait_for(final.exists, 60)
        lock.parent.mkdir(exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        try:
            assert wait_for(lambda: _try_flock(fd), 30, 0.005)
            held.set()
            final_round.wait(60)
        finally:
            os.close(fd)

    t = threading.Thread(target=hold_like_an_orphaned_rsync)
    t.start()
    code, _ = supervise(recipe)
    t.join(60)
    assert code == ExitCode.OK and held.is_set()
    assert lock_held_at_final_round == [True], "the final sync met the held lock"
    assert (published_at(recipe) / "checkpoint-30").is_dir(), "the final checkpoint was published"


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def test_checkpoint_cut_short_after_a_nan_quarantine_is_not_resumed_from(tmp_path, monkeypatch):
    from orchestrator.host.launch import local as launcher
    from orchestrator.config.recipe import load
    from orchestrator.loop.supervisor import Supervisor

    recipe = fake_recipe(tmp_path, iterations=100, faults="nan_loss@15", supervisor={"poll_s": 0.5})
    real, calls = launcher.launch, []

    def launch(*a, **k):  # the supervisor dies as it relaunches after the NaN (quarantine done)
        calls.append(1)
        if len(calls) == 2:
            raise _Killed()
        return real(*a, **k)

    monkeypatch.setattr(launcher, "launch", launch)
    with pytest.raises(_Killed):
        Supervisor(load(recipe), install_signals=False).run()
    monkeypatch.undo()
    out = tmp_path / "out"
    assert not (out / "checkpoint-20").exists()
    assert os.readlink(out / "last-checkpoint") == "checkpoint-10", "the link no longer names a quarantined step"
    # The relaunch's first save (checkpoint-20) is cut short by a full disk.
    code, sup = supervise(recipe, 'env.vars.FAKE_FAULTS="disk_full@11"')
    runs = attempts(out)
    assert code == ExitCode.OK, f"{sup.exit_reason}: {[(a.cls, a.resumed_from) for a in runs]}"
    assert all(a.start_step in (0, 10) or a.start_step > 20 for a in runs)
