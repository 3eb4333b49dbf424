"""judge(): the one verdict of a RUNNING pass, table-tested. One row per outcome, then one row per precedence
pair (the higher outcome wins when both are observed in the same pass)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from orchestrator.domain.health.action import HealthAction, Rollback, Situation, rollbacks_of
from orchestrator.domain.health.kinds import Finding
from orchestrator.loop.health import Found, HealthSeen
from orchestrator.loop.running import (Crashed, ExportExited, HealthStop, Keep, Observation, ResumedAtWrongStep,
                                       RolledBack, SlowRestart, StopRequested, TrainingOver, judge,
                                       judge_pass)
from orchestrator.types import AttemptKind, CrashClass, ExitStatus, HealthKind, Phase

QUIET = Observation(now=1000.0, exit=None, kind=AttemptKind.TRAIN, phase=Phase.TRAINING, last_step=5)
EXIT0, EXIT1, KILLED = ExitStatus(code=0), ExitStatus(code=1), ExitStatus(signal=9)

# Each observed condition, alone.
NAN = {"nan_line": ("{'loss': nan}",), "nan_step": 7}
EXPORT_EXIT = {"kind": AttemptKind.EXPORT, "exit": EXIT0}
TEARDOWN = {"exit": EXIT1, "at_end": True, "last_step": 10, "last_verified": True}
DONE = {"exit": EXIT0, "at_end": True, "last_step": 10, "last_verified": True}
TORN = {"exit": EXIT0, "at_end": True, "last_step": 10, "last_torn": ("checkpoint-10: no adapter",)}
EXITED = {"exit": EXIT1}
STOP = {"stop_requested": True}
FULL = {"disk_full": "/out: 0.1 GiB free"}
DIVERGED = {"resumed_at_wrong_step": "loss 9.0 at step 11, 1.0 before"}
HANG = {"hang": "no new training step for 700 s"}
# Run health's findings are facts; judge decides them (action.act) under the pass's Situation.
DIVERGENCE = Finding(HealthKind.LOSS_DIVERGENCE, "level 4.1 over best 1.2")   # no steps: no onset
ONSET_14 = Finding(HealthKind.LOSS_DIVERGENCE, "level 4.1 over best 1.2", first_step=14, last_step=15)
DROP = Finding(HealthKind.THROUGHPUT_DROP, "throughput 0.5x of baseline for 600 s", since=400.0, at=1000.0)
STOP_REASON = 'loss_divergence: level 4.1 over best 1.2; stopping (health.on_divergence = "stop"), checkpoints kept'
ROLLBACK_ACTION = HealthAction("rollback", "loss_divergence: level 4.1 over best 1.2; rolling back to checkpoint-10 "
                                           "(checkpoints from step 14 on are quarantined)", 10, 14)
RESTART_REASON = 'throughput 0.5x of baseline for 600 s; restarting (health.on_slowdown = "restart")'


def seen(*findings: Finding, **situation) -> HealthSeen:
    return HealthSeen(tuple(Found(f) for f in findings), Situation(**situation))


UNHEALTHY = {"health": seen(DIVERGENCE, on_divergence="stop")}
ROLLBACK = {"health": seen(ONSET_14, on_divergence="rollback", verified_steps=(5, 10, 14))}
SLOW = {"health": seen(DROP, on_slowdown="restart", now=1000.0)}


def kind_of(v) -> str:
    if isinstance(v, Crashed):
        return f"crashed:{v.crash.cls.value}" if v.crash else "crashed:classify"
    return type(v).__name__


@pytest.mark.parametrize("observed, expected", [
    ({}, "Keep"),
    (NAN, "crashed:nan_loss"),
    (EXPORT_EXIT, "ExportExited"),
    (TEARDOWN, "TrainingOver"),
    (DONE, "TrainingOver"),
    (TORN, "crashed:other"),
    (EXITED, "crashed:classify"),
    ({"exit": KILLED}, "crashed:classify"),
    ({"exit": EXIT0}, "crashed:classify"),              # exit 0 before the last step: a crash, classified
    ({**TEARDOWN, "last_verified": False}, "crashed:classify"),  # a failed end whose last save did not verify
    ({**TEARDOWN, "exit": KILLED}, "TrainingOver"),     # killed at teardown after the verified last save
    (STOP, "StopRequested"),
    (FULL, "crashed:disk_full"),
    (DIVERGED, "ResumedAtWrongStep"),
    (HANG, "crashed:nccl_timeout_hang"),
    (UNHEALTHY, "HealthStop"),
    (ROLLBACK, "RolledBack"),
    (SLOW, "SlowRestart"),
    ({"health": HealthSeen()}, "Keep"),
    ({"health": seen(Finding(HealthKind.LOSS_SPIKE, "loss 3.0 at step 4"))}, "Keep"),   # warnings alone: nothing to act on
    ({"health": seen(DIVERGENCE, on_divergence="warn")}, "Keep"),
])
def test_one_outcome(observed, expected):
    assert kind_of(judge(replace(QUIET, **observed))) == expected


# (higher, lower): observed together, the higher one decides.
PRECEDENCE = [("NAN", "EXITED"), ("NAN", "DONE"), ("NAN", "STOP"), ("NAN", "FULL"), ("NAN", "HANG"),
              ("EXPORT_EXIT", "STOP"), ("TEARDOWN", "STOP"), ("DONE", "STOP"), ("TORN", "STOP"), ("EXITED", "STOP"),
              ("EXITED", "FULL"), ("EXITED", "HANG"), ("EXITED", "DIVERGED"),
              ("STOP", "FULL"), ("STOP", "DIVERGED"), ("STOP", "HANG"),
              ("FULL", "DIVERGED"), ("FULL", "HANG"), ("DIVERGED", "HANG"),
              # run health: a NaN outranks it (and sets aside from its onset, below); it outranks completion (no
              # export or publication past a divergence's onset), a crash (no relaunch into a divergence), a stop
              # request and a full disk
              ("NAN", "UNHEALTHY"), ("UNHEALTHY", "DONE"), ("ROLLBACK", "TEARDOWN"), ("UNHEALTHY", "TORN"),
              ("UNHEALTHY", "EXITED"), ("ROLLBACK", "EXITED"), ("UNHEALTHY", "STOP"), ("ROLLBACK", "STOP"),
              ("UNHEALTHY", "FULL"), ("ROLLBACK", "HANG"), ("DIVERGED", "SLOW"), ("STOP", "SLOW"), ("SLOW", "HANG")]
ALONE = {"NAN": "crashed:nan_loss", "EXPORT_EXIT": "ExportExited", "TEARDOWN": "TrainingOver",
         "DONE": "TrainingOver", "TORN": "crashed:other", "EXITED": "crashed:classify", "STOP": "StopRequested",
         "FULL": "crashed:disk_full", "DIVERGED": "ResumedAtWrongStep", "HANG": "crashed:nccl_timeout_hang",
         "UNHEALTHY": "HealthStop", "ROLLBACK": "RolledBack", "SLOW": "SlowRestart"}


@pytest.mark.parametrize("higher, lower", PRECEDENCE)
def test_precedence(higher, lower):
    both = replace(QUIET, **{**globals()[lower], **globals()[higher]})
    assert kind_of(judge(both)) == ALONE[higher], f"{higher} outranks {lower}"


def test_verdicts_carry_what_act_needs():
    nan = judge(replace(QUIET, exit=EXIT1, **NAN))
    assert isinstance(nan, Crashed) and nan.nan_step == 7 and nan.crash.phase is Phase.TRAINING
    hang = judge(replace(QUIET, phase=Phase.STARTUP, **HANG))
    assert isinstance(hang, Crashed) and hang.hang and hang.crash.phase is Phase.STARTUP
    assert hang.crash.evidence == (HANG["hang"],)
    teardown = judge(replace(QUIET, **{**TEARDOWN, "exit": KILLED}))
    assert isinstance(teardown, TrainingOver) and "by signal 9" in teardown.teardown_failure
    assert judge(replace(QUIET, **DONE)) == TrainingOver(None)
    torn = judge(replace(QUIET, **TORN))
    assert isinstance(torn, Crashed) and torn.crash.cls is CrashClass.OTHER
    assert torn.crash.evidence[1:] == TORN["last_torn"]
    assert judge(replace(QUIET, **DIVERGED)) == ResumedAtWrongStep(DIVERGED["resumed_at_wrong_step"])
    assert judge(replace(QUIET, **STOP)) == StopRequested() and judge(QUIET) == Keep()
    assert judge(replace(QUIET, **EXPORT_EXIT)) == ExportExited()
    assert judge(replace(QUIET, **ROLLBACK)) == RolledBack(ROLLBACK_ACTION, False, 14)
    assert judge(replace(QUIET, exit=EXIT1, **UNHEALTHY)) == HealthStop(STOP_REASON)
    assert judge(replace(QUIET, **SLOW)) == SlowRestart(RESTART_REASON)


@pytest.mark.parametrize("nan_step, onset, first", [(7, None, 7), (7, 5, 5), (7, 9, 7)])
def test_a_nan_that_wins_the_pass_sets_aside_from_the_earliest_onset_any_finding_names(nan_step, onset, first):
    """A loss over the limit at step 5 and a NaN at 7 read in one pass: the NaN decides, but checkpoint-5 (saved
    over the limit) is no more healthy than checkpoint-7."""
    health = HealthSeen() if onset is None else seen(
        Finding(HealthKind.LOSS_LIMIT, "loss 50 over 10", first_step=onset, last_step=onset),
        on_divergence="rollback", verified_steps=(2,))
    obs = replace(QUIET, nan_line=("{'loss': nan}",), nan_step=nan_step, health=health)
    v = judge(obs)
    assert isinstance(v, Crashed) and v.nan_step == nan_step and v.set_aside_from == first


def test_a_stop_carries_the_onset_it_sets_aside_from():
    limit = Finding(HealthKind.LOSS_LIMIT, "50 over 10", first_step=8, last_step=9)
    v = judge(replace(QUIET, **DONE, health=seen(limit, on_divergence="stop")))
    assert isinstance(v, HealthStop) and v.set_aside_from == 8


# ---- the health events a pass records: each says what was done about its finding ----------------------------
LIMIT_22 = Finding(HealthKind.LOSS_LIMIT, "loss 50 over 10", first_step=22, last_step=23, value=50.0, threshold=10.0)
SPIKE = Finding(HealthKind.LOSS_SPIKE, "loss 3.0 at step 4, 2x its level", first_step=4, last_step=4)
ROLL_22 = {"on_divergence": "rollback", "verified_steps": (10, 20, 22)}


def nan_at(step: int) -> dict:
    return {"nan_line": ("{'loss': nan}",), "nan_step": step}


def recorded(e) -> tuple:
    d = e.data
    return e.kind, d["action"], d["taken"], d.get("set_aside_from"), d.get("proposed")


@pytest.mark.parametrize("observed, verdict, expected", [
    # a finding and a NaN in one pass: the NaN crash is taken and sets aside from the finding's onset; it relaunches
    # from checkpoint-20, what the rollback proposed, so it is that rollback (rollbacks_of counts it)
    ({**nan_at(24), "health": seen(LIMIT_22, **ROLL_22)}, "crashed:nan_loss",
     [("loss_limit", "rollback", "crashed:nan_loss", 22, None)]),
    ({**nan_at(21), "health": seen(LIMIT_22, **ROLL_22)}, "crashed:nan_loss",   # from the NaN: still before 22, from 20
     [("loss_limit", "rollback", "crashed:nan_loss", 21, None)]),
    ({**nan_at(15), "health": seen(LIMIT_22, **ROLL_22)}, "crashed:nan_loss",   # relaunched from 10: not that rollback
     [("loss_limit", "superseded", "crashed:nan_loss", 15, "rollback")]),
    ({**nan_at(24), "health": seen(LIMIT_22, on_divergence="stop")}, "crashed:nan_loss",   # no stop: a relaunch
     [("loss_limit", "superseded", "crashed:nan_loss", 22, "stop")]),
    # a warning alongside a crash: recorded, action warn
    ({**EXITED, "health": seen(SPIKE)}, "crashed:classify", [("loss_spike", "warn", "crashed", None, None)]),
    ({**nan_at(24), "health": seen(SPIKE, LIMIT_22, **ROLL_22)}, "crashed:nan_loss",
     [("loss_spike", "warn", "crashed:nan_loss", None, None), ("loss_limit", "rollback", "crashed:nan_loss", 22, None)]),
    # a rollback or a stop found in the same pass as the completion: it wins, as the table says
    ({**DONE, "health": seen(LIMIT_22, **ROLL_22)}, "RolledBack",
     [("loss_limit", "rollback", "rolled_back", 22, None)]),
    ({**DONE, "health": seen(LIMIT_22, on_divergence="stop")}, "HealthStop",
     [("loss_limit", "stop", "health_stop", 22, None)]),
    # a stop and a rollback in one pass: the stop wins, the rollback is not done; the run sets aside from the earliest
    ({"health": seen(ONSET_14, Finding(HealthKind.GRAD_NORM_LIMIT, "grad norm 900 over 100", first_step=9,
                                       last_step=9), on_divergence="rollback", verified_steps=(10,))}, "HealthStop",
     [("loss_divergence", "superseded", "health_stop", 9, "rollback"), ("grad_norm_limit", "stop", "health_stop", 9,
                                                                        None)]),
    # a restart superseded by a crash that outranks it: not done (the supervisor's last_restart_at stays)
    ({**EXITED, **SLOW}, "crashed:classify", [("throughput_drop", "superseded", "crashed", None, "restart")]),
    ({**FULL, **SLOW}, "crashed:disk_full", [("throughput_drop", "superseded", "crashed:disk_full", None, "restart")]),
    ({**STOP, **SLOW}, "StopRequested", [("throughput_drop", "superseded", "stop_requested", None, "restart")]),
    # a hang does not outrank a slow restart (the precedence above): the restart is what is done
    ({**HANG, **SLOW}, "SlowRestart", [("throughput_drop", "restart", "slow_restart", None, None)]),
    ({**SLOW}, "SlowRestart", [("throughput_drop", "restart", "slow_restart", None, None)]),
    ({"health": seen(DROP, on_slowdown="restart", now=1000.0, last_restart_at=900.0)}, "Keep",   # within the hour
     [("throughput_drop", "warn", "keep", None, None)]),
])
def test_each_health_event_says_the_action_taken(observed, verdict, expected):
    judged = judge_pass(replace(QUIET, **observed))
    assert kind_of(judged.verdict) == verdict
    assert [recorded(e) for e in judged.events] == expected


def test_a_superseded_rollback_keeps_its_numbers_and_is_no_rollback_for_the_recurrence_rule():
    (e,) = judge_pass(replace(QUIET, **nan_at(15), health=seen(LIMIT_22, **ROLL_22))).events
    assert e.data["relaunch_from"] == 20 and e.data["quarantine_from"] == 22 and e.data["value"] == 50.0
    assert rollbacks_of([{"kind": e.kind, "data": e.data}]) == []
    (done,) = judge_pass(replace(QUIET, **nan_at(24), health=seen(LIMIT_22, **ROLL_22))).events
    assert rollbacks_of([{"kind": done.kind, "data": done.data}]) == [Rollback(22, 23, 20)]


def test_a_throughput_drop_event_carries_its_evidence_and_why():
    found = Found(DROP, "; another process used the GPU", {"clues": ["another process used the GPU"]})
    (e,) = judge_pass(replace(QUIET, health=HealthSeen((found,), Situation(on_slowdown="warn")))).events
    assert e.message == DROP.message + "; another process used the GPU"
    assert e.data["clues"] == ["another process used the GPU"] and e.data["why"] == 'health.on_slowdown = "warn"'
    assert judge(replace(QUIET, health=HealthSeen((found,), Situation(on_slowdown="restart", now=1000.0)))) == \
        SlowRestart(RESTART_REASON), "the restart's reason is the finding's, without the machine's clues"


@pytest.mark.parametrize("observed", [{**nan_at(24), "health": seen(SPIKE, LIMIT_22, **ROLL_22)}, SLOW, ROLLBACK,
                                      {**DONE, "health": seen(LIMIT_22, on_divergence="stop")}])
def test_judge_touches_only_its_argument(observed):
    """judge is pure: the same Observation gives the same result twice, and is left as it was."""
    obs = replace(QUIET, **observed)
    before = copy.deepcopy(obs)
    first, second = judge_pass(obs), judge_pass(obs)
    assert first == second and judge(obs) == first.verdict
    assert obs == before


def test_a_rollback_sets_aside_from_the_earliest_onset_of_the_pass():
    """Two acted-on findings in one pass: the loss limit from step 12, the divergence from 14: the rollback
    (the first finding's) sets aside from 12, whichever finding decided it."""
    limit = Finding(HealthKind.LOSS_LIMIT, "50 over 10", first_step=12, last_step=15)
    v = judge(replace(QUIET, health=seen(ONSET_14, limit, on_divergence="rollback", verified_steps=(5, 10, 14))))
    assert isinstance(v, RolledBack) and v.set_aside_from == 12
