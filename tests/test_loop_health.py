"""Run health in the loop, on the in-memory host: what a RUNNING pass does about each health finding (the
detectors themselves are table-tested in test_health*.py and test_throughput.py)."""
from __future__ import annotations

import pytest

from checkpoint_dirs import make_megatron
from loop_world import OOM, journal, running
from orchestrator.types import State

N = 40
LORA = {"rank": 8, "alpha": 32}   # what checkpoint_dirs writes: the checkpoints verify


def world_with(world, **health):
    return world(optim={"iterations": N}, lora=LORA, health=health)


def events(sup, kind):
    return [e for e in journal(sup).events(500) if e["kind"] == kind]


def steps(t, first, last, loss=1.0):
    t.steps(first, last, N, loss)


def saved(sup, *at):
    for s in at:
        make_megatron(sup.ctx.out, s)


def test_a_normal_run_raises_no_health_event(world):
    sup, host = world_with(world)
    t = running(sup, host)
    for s in range(1, N + 1):   # noisy but healthy: no spike, no divergence
        steps(t, s, s, loss=2.0 - s / N + (0.05 if s % 3 else -0.05))
        assert sup.step() is State.RUNNING
    t.exit(code=0)
    assert sup.step() is State.COMPLETED
    kinds = {e["kind"] for e in journal(sup).events(500)}
    assert not kinds & {"loss_spike", "grad_norm_spike", "loss_divergence", "loss_limit", "resume_divergence",
                        "progress_unreadable", "throughput_drop"}, kinds


def test_a_loss_over_the_limit_stops_gracefully_with_exit_3(world):
    sup, host = world_with(world, loss_max=10.0)
    t = running(sup, host)
    steps(t, 1, 5)
    assert sup.step() is State.RUNNING
    steps(t, 6, 6, loss=50.0)
    assert sup.step() is State.GAVE_UP
    assert any(c[0] == "terminate" for c in host.calls), "a graceful stop: SIGTERM first"
    (limit,) = events(sup, "loss_limit")
    assert limit["data"]["action"] == "stop" and limit["data"]["threshold"] == 10.0
    assert "loss_limit" in sup.exit_reason
    row = journal(sup).last_attempt()
    assert row.ended_at is not None and row.cls is None and "loss_limit" in " ".join(row.evidence)
    sup.shutdown()
    assert journal(sup).get_all()["exit_reason"] == sup.exit_reason


def test_warn_records_and_trains_on(world):
    sup, host = world_with(world, loss_max=10.0, on_divergence="warn")
    t = running(sup, host)
    steps(t, 1, 5)
    steps(t, 6, 6, loss=50.0)
    assert sup.step() is State.RUNNING
    (limit,) = events(sup, "loss_limit")
    assert limit["data"]["action"] == "warn"
    assert b'orchestrator_health_events_total{kind="loss_limit"} 1.0' in sup.metrics.exposition()


def test_rollback_quarantines_from_the_onset_relaunches_before_it_and_stops_on_recurrence(world):
    sup, host = world_with(world, loss_max=10.0, on_divergence="rollback")
    t = running(sup, host)
    saved(sup, 10, 20)
    steps(t, 1, 21)
    host.mono += 5   # the next pass scans (and verifies) the checkpoints
    assert sup.step() is State.RUNNING
    saved(sup, 24)   # written after the onset (at step 22): quarantined
    steps(t, 22, 24, loss=50.0)
    assert sup.step() is State.VERIFYING
    (first,) = events(sup, "loss_limit")
    assert first["data"]["action"] == "rollback" and first["data"]["relaunch_from"] == 20
    assert not (sup.ctx.out / "checkpoint-24").exists()
    assert (sup.ctx.out / "checkpoint-24.suspect-attempt-1").is_dir() and (sup.ctx.out / "checkpoint-20").is_dir()
    t2 = running(sup, host)
    assert t2.cmd.argv.count("--mcore_adapter") == 1
    assert t2.cmd.argv[t2.cmd.argv.index("--mcore_adapter") + 1] == str(sup.ctx.out / "checkpoint-20")
    steps(t2, 21, 22, loss=50.0)   # the same symptom in the same steps: the data order repeats it
    assert sup.step() is State.GAVE_UP
    assert "same symptom again" in sup.exit_reason
    assert [e["data"]["action"] for e in events(sup, "loss_limit")] == ["rollback", "stop"]


def test_a_resume_from_wrong_weights_relaunches_once_from_the_checkpoint_before_then_stops(world):
    """The field's case: the resumed attempt's losses jump; its checkpoint is suspect: quarantined, one relaunch
    from the one before it; when that jumps too, the resume path itself is broken: stop."""
    sup, host = world_with(world)
    t = running(sup, host)
    saved(sup, 10, 20)
    steps(t, 1, 22)
    host.mono += 5
    assert sup.step() is State.RUNNING
    t.write(OOM)
    t.exit(code=1)
    assert sup.step() is State.CRASHED
    t2 = running(sup, host)
    assert str(sup.ctx.out / "checkpoint-20") in t2.cmd.argv
    steps(t2, 21, 22, loss=4.0)   # redone steps, losses far from the 1.0 logged before
    assert sup.step() is State.VERIFYING
    (first,) = events(sup, "resume_divergence")
    assert first["data"]["action"] == "rollback" and first["data"]["relaunch_from"] == 10
    assert (sup.ctx.out / "checkpoint-20.suspect-attempt-2").is_dir()
    t3 = running(sup, host)
    assert str(sup.ctx.out / "checkpoint-10") in t3.cmd.argv
    steps(t3, 11, 12, loss=4.0)
    assert sup.step() is State.GAVE_UP
    assert "resume path itself is broken" in sup.exit_reason and sup.exit_reason.startswith("resume divergence")
    assert b"orchestrator_resume_divergence_total 2.0" in sup.metrics.exposition()


def test_unreadable_progress_is_reported_once_and_keeps_the_attempt_alive(world):
    sup, host = world(optim={"iterations": N}, supervisor={"startup_timeout_s": 60})
    t = running(sup, host)
    for i in range(1, 40):   # 2 minutes of a format the parser does not know, one line a pass
        t.write(f"[rank0] it {i}/{N} | loss=1.{i:02d} | 3.1 s/it")
        host.mono += 3
        assert sup.step() is State.RUNNING, sup.attempt.crash
    (unreadable,) = events(sup, "progress_unreadable")
    assert "it 3/40" in unreadable["data"]["sample"]
    host.mono += 4000   # silence: now it is a hang
    assert sup.step() is State.CRASHED


@pytest.mark.parametrize("on_slowdown, after", [("warn", State.RUNNING), ("restart", State.VERIFYING)])
def test_a_sustained_slowdown_is_reported_with_evidence_and_restarts_when_asked(world, on_slowdown, after):
    sup, host = world(optim={"iterations": 2000}, lora=LORA,
                      health={"slowdown_window_s": 20, "on_slowdown": on_slowdown})
    t = running(sup, host)
    step = 0
    for _ in range(60):     # one step a pass (0.5 s): the baseline
        step += 1
        t.steps(step, step, 2000)
        assert sup.step() is State.RUNNING
    state = State.RUNNING
    for i in range(400):    # one step every 4 passes: 4x slower
        if i % 4 == 0:
            step += 1
            t.steps(step, step, 2000)
        state = sup.step()
        if events(sup, "throughput_drop"):
            break
    (drop,) = events(sup, "throughput_drop")
    assert drop["data"]["ratio"] > 1.5 and drop["data"]["action"] == ("restart" if on_slowdown == "restart" else "warn")
    assert drop["data"]["evidence"] is not None, "the machine's evidence at the drop"
    assert state is after
    if after is State.RUNNING:
        for _ in range(120):   # back to speed: recovered, and the slow time is a `slow` span
            step += 1
            t.steps(step, step, 2000)
            sup.step()
        assert events(sup, "throughput_recovered")
        assert [k for _, _, k in journal(sup).spans()].count("slow") == 1
