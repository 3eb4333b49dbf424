"""Run health judged in the loop (issue 31, item 4), on the in-memory host: the Observation carries findings as
facts, judge decides them with the pass's other outcomes, and the journal's events say what was done (the table
rows are in test_judge.py)."""
from __future__ import annotations

from dataclasses import replace

from checkpoint_dirs import make_megatron
from gate_world import LORA, NAN_LINE, N, a_pass, events, train_to, world_with
from loop_world import running
from orchestrator.types import HealthKind, State


def test_a_finding_and_a_nan_in_one_pass_journal_the_nan_crash_taken_from_the_onset(world):
    sup, host = world_with(world, health={"loss_max": 10.0, "on_divergence": "rollback"})
    t = running(sup, host)
    train_to(sup, host, t, 21)
    make_megatron(sup.ctx.out, 22)
    t.steps(22, 23, N, loss=50.0)
    t.write(NAN_LINE % 24)
    assert a_pass(sup, host) is State.CRASHED
    (limit,) = events(sup, "loss_limit")
    d = limit["data"]
    assert d["taken"] == "crashed:nan_loss" and d["set_aside_from"] == 22
    assert d["action"] == "rollback" and d["relaunch_from"] == 20, "set aside from its onset, relaunched from 20"


def slow_run(world, hook=None):
    """A run that slows down 4x after a 60-step baseline, until the pass that finds the drop; `hook(obs)` may change
    that pass's Observation (another outcome seen in the same pass)."""
    sup, host = world(optim={"iterations": 2000}, lora=LORA,
                      health={"slowdown_window_s": 20, "on_slowdown": "restart"})
    t = running(sup, host)
    observe = sup.parts.observer.observe
    if hook:
        sup.parts.observer.observe = lambda a: (lambda obs: hook(obs) if obs.health.found else obs)(observe(a))
    step = 0
    for _ in range(60):
        step += 1
        t.steps(step, step, 2000)
        assert sup.step() is State.RUNNING
    for i in range(400):
        if i % 4 == 0:
            step += 1
            t.steps(step, step, 2000)
        state = sup.step()
        if events(sup, "throughput_drop"):
            return sup, host, state
    raise AssertionError("no throughput_drop")


def test_a_slow_restart_carried_out_starts_the_hour_before_the_next(world):
    sup, host, state = slow_run(world)
    assert state is State.VERIFYING
    (drop,) = events(sup, "throughput_drop")
    assert drop["data"]["action"] == "restart" and drop["data"]["taken"] == "slow_restart"
    assert sup.parts.health.last_restart_at == drop["at"]


def test_a_slow_restart_superseded_in_its_pass_is_not_counted_as_a_restart(world):
    def stop_too(obs):
        assert [fd.finding.kind for fd in obs.health.found] == [HealthKind.THROUGHPUT_DROP]
        return replace(obs, stop_requested=True)

    sup, host, state = slow_run(world, stop_too)
    assert state is State.STOPPING
    (drop,) = events(sup, "throughput_drop")
    assert drop["data"]["action"] == "superseded" and drop["data"]["proposed"] == "restart"
    assert drop["data"]["taken"] == "stop_requested"
    assert sup.parts.health.last_restart_at is None, "no restart was done: the next drop may restart"
