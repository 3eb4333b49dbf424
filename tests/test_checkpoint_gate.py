"""One checkpoint gate (issue 31): the scenarios that let an unhealthy checkpoint be resumed from, published or
merged, each as a regression test on the in-memory host with real checkpoint directories, a real journal and
real sync rounds (tests/test_checkpoint_gate_matrix.py crosses them with the moments a fault can come)."""
from __future__ import annotations

from pathlib import Path

from checkpoint_dirs import make_megatron
from gate_world import (LORA, NAN_LINE, N, a_pass, events, kill_after_save, poison, publish_now, published_steps,
                        resumed_from, stale_copy, standing, train_to, world_with)
from loop_world import OOM, drive, journal, running
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.store import sync
from orchestrator.store.published import publish_dir
from orchestrator.store.standing import Standings
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.types import Alert, CrashClass, Standing, State

# ---- a poisoned save is never the resume point -----------------------------------------------------------
def test_a_nonfinite_save_the_trainer_died_right_after_is_not_resumed_from(world):
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 21)
    poison(make_megatron(sup.ctx.out, 24))
    kill_after_save(sup, host, t, 24)
    t2 = running(sup, host)   # the relaunch awaited checkpoint-24's content check before choosing
    assert resumed_from(t2) == str(sup.ctx.out / "checkpoint-20")
    assert (sup.ctx.out / "checkpoint-24.checkpoint_nonfinite").is_dir() and not (sup.ctx.out / "checkpoint-24").exists()
    assert standing(sup, 24) == Standing.SET_ASIDE and standing(sup, 20) == Standing.HEALTHY
    (found,) = events(sup, "checkpoint_nonfinite")
    assert found["data"]["step"] == 24


def test_a_stale_save_the_trainer_died_right_after_is_not_resumed_from(world):
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 21)
    stale_copy(sup.ctx.out, 20, 24)
    kill_after_save(sup, host, t, 24)
    t2 = running(sup, host)
    assert resumed_from(t2) == str(sup.ctx.out / "checkpoint-20")
    assert (sup.ctx.out / "checkpoint-24.checkpoint_unchanged").is_dir()
    assert [e["data"]["previous_step"] for e in events(sup, "checkpoint_unchanged")] == [20]


# ---- a manifest is no proof of a health check -------------------------------------------------------------
def tracker(tmp_path: Path, out: Path, journal_: Journal) -> CheckpointTracker:
    from recipes import write_recipe
    from orchestrator.config.recipe import load
    recipe = load(write_recipe(tmp_path, run={"output_dir": str(out), "persistent_dir": str(tmp_path / "pers")},
                               lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
    return CheckpointTracker(recipe, "hash", out, journal_, Metrics(), on_saved=lambda: None)


def test_a_manifest_written_by_a_sync_round_first_does_not_turn_the_content_check_off(tmp_path):
    out = tmp_path / "out"
    make_megatron(out, 10)
    poison(make_megatron(out, 20))
    pers = tmp_path / "pers-flat"
    sync.sync_once(out, pers, "megatron", "hash")   # an ungated round (an earlier release) hashed both first
    assert (out / "checkpoint-20" / "orchestrator-manifest.json").exists()
    rc = tracker(tmp_path, out, Journal(tmp_path / "journal.sqlite"))
    rc.scan(0.0)
    assert rc.wait_checks(60)
    rc.close()
    assert (out / "checkpoint-20.checkpoint_nonfinite").is_dir()
    assert rc.resume_point().step == 10


def test_a_round_that_reaches_a_new_checkpoint_before_its_check_publishes_nothing_of_it(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    make_megatron(out, 10)
    j = Journal(tmp_path / "journal.sqlite")
    rc = tracker(tmp_path, out, j)
    rc.scan(0.0)
    assert rc.wait_checks(60)
    poison(make_megatron(out, 20))
    rc.scan(1.0)   # verified, its content check submitted ...
    gate = rc.standings.publish_refusal
    r = sync.sync_once(out, pers, "megatron", "hash", gate=gate)   # ... and a round comes first
    assert r.copied == ("checkpoint-10",), r
    assert any("content check is not done" in s for s in r.skipped)
    assert rc.wait_checks(60)
    rc.close()
    r = sync.sync_once(out, pers, "megatron", "hash", gate=gate)
    assert not (pers / "checkpoint-20").exists() and r.newest_published == 10
    assert sorted(p.name for p in pers.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-10"]


def test_sync_once_from_the_cli_checks_what_no_supervisor_judged(tmp_path, write_recipe):
    from orchestrator.config.recipe import load
    from orchestrator.store.publisher import sync_recipe
    out = tmp_path / "out"
    make_megatron(out, 10)
    poison(make_megatron(out, 20))
    r = load(write_recipe(run={"output_dir": str(out), "persistent_dir": str(tmp_path / "pers")}, lora=LORA))
    res = sync_recipe(r)
    assert res["names"] == ["checkpoint-10"] and any("NaN or Inf" in s for s in res["skipped"]), res


# ---- findings move the published copies too, durably --------------------------------------------------------
def test_a_nan_sets_aside_the_published_copy_saved_before_it_was_seen(world, tmp_path):
    sup, host = world_with(world, persistent=tmp_path / "pers")
    t = running(sup, host)
    train_to(sup, host, t, 25, saves=(10, 20, 24))
    publish_now(sup)
    assert 24 in published_steps(sup)   # healthy, published (by this round or the supervisor's thread)
    t.write(NAN_LINE % 24)   # ... and the log shows a NaN at its step
    assert a_pass(sup, host) is State.CRASHED
    drive(sup, State.RUNNING)
    assert all(s < 24 for s in published_steps(sup))
    assert not journal(sup).get_all().get("nan_pending") and not sup.ctx.standings.pending


def test_a_sync_lock_held_for_minutes_keeps_the_set_aside_pending_and_retried(world, tmp_path):
    sup, host = world_with(world, persistent=tmp_path / "pers")
    t = running(sup, host)
    train_to(sup, host, t, 25, saves=(10, 20, 24))
    publish_now(sup)
    r = sup.ctx.recipe.run
    fd = sync.open_lock(publish_dir(r.persistent_dir, r.name, sup.hash), wait_s=60)   # a round copying for minutes
    try:
        t.write(NAN_LINE % 24)
        assert a_pass(sup, host) is State.CRASHED
        assert sup.step() is State.CLEANING and sup.step() in (State.WAITING, State.BACKOFF)
        assert 24 in published_steps(sup), "not moved while the lock is held"
        assert journal(sup).get_all().get("nan_pending") and sup.ctx.standings.pending, "kept until every copy moved"
        assert any("wait for the sync lock" in e["message"] for e in events(sup, "quarantine"))
        assert "checkpoint-24" in (sup.ctx.standings.publish_refusal(24, str(sup.ctx.out / "checkpoint-24")) or "")
        from rich.console import Console
        from orchestrator.ops import report, status_view
        d = report.status_data(sup.ctx.recipe, journal(sup))   # what `orchestrator status` shows an operator
        assert d["set_aside_pending"][0]["from_step"] == 24 and d["standings"][24] == "set_aside"
        console = Console(record=True, width=160, color_system=None)
        status_view.status_view(sup.ctx.recipe, journal(sup), console=console)
        assert "checkpoint-24 on (nan): published copies still to move" in console.export_text()
    finally:
        sync.os.close(fd)
    drive(sup, State.RUNNING)   # the next housekeeping moves it
    assert 24 not in published_steps(sup)
    assert not sup.ctx.standings.pending and not journal(sup).get_all().get("nan_pending")


def test_a_set_aside_survives_a_supervisor_killed_before_it_moved_anything(world, write_recipe):
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 25, saves=(10, 20, 24))
    t.write(NAN_LINE % 24)
    assert a_pass(sup, host) is State.CRASHED   # the request is in the journal; nothing moved yet
    assert (sup.ctx.out / "checkpoint-24").is_dir()
    sup.ctx.release()   # kill -9: no shutdown, no cleanup; the locks go with the process
    sup.ctx.closed = True
    again, host2 = world_with(world)
    drive(again, State.RUNNING)
    assert not (again.ctx.out / "checkpoint-24").exists() and list(again.ctx.out.glob("checkpoint-24.nan-attempt-1"))
    assert resumed_from(host2.trainers[-1]) == str(again.ctx.out / "checkpoint-20")
    first = journal(again).attempts()[0]
    assert first.cls is CrashClass.NAN_LOSS, "the NaN still counts for the crash policy (nan_loss twice gives up)"


# ---- a finding is not lost when another outcome wins the pass -----------------------------------------------
def test_a_loss_limit_and_a_nan_in_one_pass_set_aside_from_the_limit_and_recur(world):
    sup, host = world_with(world, health={"loss_max": 10.0, "on_divergence": "rollback"})
    t = running(sup, host)
    train_to(sup, host, t, 21)
    make_megatron(sup.ctx.out, 22)   # saved over the limit
    t.steps(22, 23, N, loss=50.0)
    t.write(NAN_LINE % 24)
    assert a_pass(sup, host) is State.CRASHED   # the NaN wins the pass ...
    t2 = running(sup, host)
    assert resumed_from(t2) == str(sup.ctx.out / "checkpoint-20"), "... but 22, saved over the limit, is set aside"
    assert list(sup.ctx.out.glob("checkpoint-22.nan-attempt-1"))
    (limit,) = events(sup, "loss_limit")
    assert limit["data"]["relaunch_from"] == 20   # what the journal says is what was done
    t2.steps(21, 21, N)   # redone: not compared with the diverged attempt's losses (none at 21, 50 from 22)
    t2.steps(22, 22, N, loss=50.0)   # the same symptom at the same step: found again (not latched): recurrence
    assert a_pass(sup, host) is State.GAVE_UP
    assert "same symptom again" in sup.exit_reason
    assert not events(sup, "resume_divergence")


def test_a_divergence_found_in_the_final_drain_is_not_exported(world):
    sup, host = world_with(world, health={"loss_max": 10.0}, checkpoint={"merge": "final"})
    t = running(sup, host)
    train_to(sup, host, t, 30, saves=(10, 20, 30))
    make_megatron(sup.ctx.out, 40)
    t.steps(31, 40, N, loss=50.0)   # over the limit from 31 to the end ...
    t.exit(code=0)   # ... read in the drain of a completed run
    assert a_pass(sup, host) is State.GAVE_UP
    assert "loss_limit" in sup.exit_reason
    assert not (sup.ctx.out / "checkpoint-40").exists() and list(sup.ctx.out.glob("checkpoint-40.suspect-attempt-1"))
    assert not events(sup, "training_done") and len(host.trainers) == 1, "no export launched"


# ---- state that belongs to one attempt ---------------------------------------------------------------------
def test_a_resume_divergence_after_a_good_retry_is_a_new_rollback_not_a_broken_resume_path(world):
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 22)
    t.write(OOM)
    t.exit(code=1)
    assert a_pass(sup, host) is State.CRASHED
    t2 = running(sup, host)
    t2.steps(21, 22, N, loss=4.0)   # wrong weights: suspect checkpoint-20, retry from 10
    assert a_pass(sup, host) is State.VERIFYING
    t3 = running(sup, host)
    assert resumed_from(t3) == str(sup.ctx.out / "checkpoint-10")
    t3.steps(11, 31, N)   # the retry is fine and saves again
    for s in (20, 30):
        make_megatron(sup.ctx.out, s)
    assert a_pass(sup, host) is State.RUNNING
    assert sup.ctx.checkpoints.wait_checks(60)
    t3.write(OOM)
    t3.exit(code=1)
    assert a_pass(sup, host) is State.CRASHED
    t4 = running(sup, host)
    assert resumed_from(t4) == str(sup.ctx.out / "checkpoint-30")
    t4.steps(31, 32, N, loss=4.0)   # an ordinary resume divergence, attempts later
    assert a_pass(sup, host) is State.VERIFYING, sup.exit_reason
    assert events(sup, "resume_divergence")[-1]["data"]["action"] == "rollback"


def test_the_throughput_drop_alert_ends_with_its_attempt(world):
    sup, host = world_with(world)
    t = running(sup, host)
    sup.metrics.alert(Alert.THROUGHPUT_DROP, True)   # raised during the attempt
    t.steps(1, 3, N)
    t.write(OOM)
    t.exit(code=1)
    assert a_pass(sup, host) is State.CRASHED
    assert b'orchestrator_alert_active{alert="throughput_drop"} 0.0' in sup.metrics.exposition()


def test_standings_survive_a_supervisor_restart(tmp_path):
    out = tmp_path / "out"
    make_megatron(out, 10)
    j = Journal(tmp_path / "journal.sqlite")
    rc = tracker(tmp_path, out, j)
    rc.scan(0.0)
    assert rc.wait_checks(60)
    rc.close()
    assert Standings(j).of(10).standing is Standing.HEALTHY
    again = tracker(tmp_path, out, j)   # judged before: trusted, not checked again
    again.scan(1.0)
    assert not again.pending_checks() and again.resume_point().step == 10
    again.close()


# ---- the relaunch awaits the candidate's check, bounded, in a span ------------------------------------------
def slow_checks(monkeypatch, release):
    """Content checks that block until `release` is set (a 397B adapter's scan, say)."""
    from orchestrator.store import checkpoint_health
    real = checkpoint_health.CheckpointHealth.check

    def check(self, path, step, mani=None):
        if step == 24:
            release.wait(60)
        return real(self, path, step, mani)
    monkeypatch.setattr(checkpoint_health.CheckpointHealth, "check", check)


def test_the_relaunch_waits_for_the_candidates_check_and_charges_it_to_a_span(world, monkeypatch):
    import threading
    from orchestrator.loop import launch
    release = threading.Event()
    slow_checks(monkeypatch, release)
    monkeypatch.setattr(launch, "WAIT_SLICE_S", 0.05)
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 21)
    poison(make_megatron(sup.ctx.out, 24))
    waits = []
    host.on_wait = lambda h, s: waits.append(s) if len(waits) < 10 else release.set()   # ends some waits later
    kill_after_save(sup, host, t, 24)
    try:
        t2 = running(sup, host)
    finally:
        release.set()
    assert resumed_from(t2) == str(sup.ctx.out / "checkpoint-20")
    assert (sup.ctx.out / "checkpoint-24.checkpoint_nonfinite").is_dir()
    verify = [e - s for s, e, kind in journal(sup).spans() if kind == "verify"]
    assert verify and max(verify) > 0, "the wait for the check is charged to `verify`, not `other`"


def test_a_check_that_outlasts_the_bound_leaves_its_checkpoint_out_of_the_resume(world, monkeypatch):
    import threading
    from orchestrator.loop import launch
    release = threading.Event()
    slow_checks(monkeypatch, release)
    monkeypatch.setattr(launch, "WAIT_SLICE_S", 0.05)
    monkeypatch.setattr(launch, "CONTENT_CHECK_WAIT_S", 1.0)
    sup, host = world_with(world)
    t = running(sup, host)
    train_to(sup, host, t, 21)
    make_megatron(sup.ctx.out, 24)   # healthy, but its check does not finish in time
    try:
        kill_after_save(sup, host, t, 24)
        t2 = running(sup, host)
        assert resumed_from(t2) == str(sup.ctx.out / "checkpoint-20")
        assert any("still running" in e["message"] for e in events(sup, "resume_skip"))
    finally:
        release.set()


def test_a_poisoned_copy_restored_on_a_new_machine_is_checked_before_it_is_resumed_from(world, tmp_path):
    """A copy an earlier release published unchecked: restored onto an empty output_dir, content-checked like a
    local save, set aside (locally and its published copy) and not resumed from."""
    from orchestrator.config.recipe import recipe_hash
    sup, host = world_with(world, persistent=tmp_path / "pers")
    r = sup.recipe
    h = recipe_hash(r)
    src = tmp_path / "elsewhere"
    poison(make_megatron(src, 30))
    sync.sync_once(src, publish_dir(r.run.persistent_dir, r.run.name, h), "megatron", h)   # ungated, as before
    t = running(sup, host)
    assert resumed_from(t) is None, "started fresh, not from the poisoned copy"
    assert (sup.ctx.out / "checkpoint-30.checkpoint_nonfinite").is_dir()
    for _ in range(20):
        if not sup.ctx.standings.pending:
            break
        a_pass(sup, host)
    assert 30 not in published_steps(sup)


def test_a_checkpoint_set_aside_and_put_back_by_a_person_is_judged_afresh(tmp_path):
    """The runbook's way to use a checkpoint a health stop set aside: rename it back; it is checked like a new save
    (healthy bytes: usable again; while a move is still pending it stays aside)."""
    out = tmp_path / "out"
    make_megatron(out, 10)
    make_megatron(out, 20)
    j = Journal(tmp_path / "journal.sqlite")
    rc = tracker(tmp_path, out, j)
    rc.scan(0.0)
    assert rc.wait_checks(60)
    from orchestrator.store.standing import SetAside
    from orchestrator.types import SetAsideReason
    req = rc.standings.request(SetAside(20, SetAsideReason.DIVERGED, 1, "the onset of a divergence at step 20"))
    assert rc.set_aside_local(req)
    rc.standings.progressed(rc.standings.current(req), published=True)
    assert rc.resume_point().step == 10
    (moved,) = out.glob("checkpoint-20.suspect-attempt-1")
    moved.rename(out / "checkpoint-20")   # a person looked at it and wants it
    rc.scan(1.0)
    assert rc.wait_checks(60)
    assert rc.resume_point().step == 20
    rc.close()
