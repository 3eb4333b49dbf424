"""judge(): the one verdict of a RUNNING pass, table-tested. One row per outcome, then one row per precedence
pair (the higher outcome wins when both are observed in the same pass)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.domain.health.action import HealthAction
from orchestrator.loop.health import HealthSeen
from orchestrator.loop.running import (Crashed, ExportExited, HealthStop, Keep, Observation, ResumedAtWrongStep,
                                       RolledBack, SlowRestart, StopRequested, TrainingOver, judge)
from orchestrator.types import AttemptKind, CrashClass, ExitStatus, Phase

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
ROLLBACK_ACTION = HealthAction("rollback", "loss_divergence: ...; rolling back to checkpoint-10", 10, 14)
UNHEALTHY = {"health": HealthSeen(stop="loss_divergence: level 4.1 over best 1.2; stopping")}
ROLLBACK = {"health": HealthSeen(rollback=ROLLBACK_ACTION)}
SLOW = {"health": HealthSeen(restart="throughput 0.5x of baseline for 600 s; restarting")}


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
    ({"health": HealthSeen(events=())}, "Keep"),          # warnings alone: nothing to act on
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
    assert judge(replace(QUIET, **ROLLBACK)) == RolledBack(ROLLBACK_ACTION, False)
    assert judge(replace(QUIET, exit=EXIT1, **UNHEALTHY)) == HealthStop(UNHEALTHY["health"].stop)
    assert judge(replace(QUIET, **SLOW)) == SlowRestart(SLOW["health"].restart)


@pytest.mark.parametrize("nan_step, onset, first", [(7, None, 7), (7, 5, 5), (7, 9, 7)])
def test_a_nan_that_wins_the_pass_sets_aside_from_the_earliest_onset_any_finding_names(nan_step, onset, first):
    """A loss over the limit at step 5 and a NaN at 7 read in one pass: the NaN decides, but checkpoint-5 (saved
    over the limit) is no more healthy than checkpoint-7."""
    obs = replace(QUIET, nan_line=("{'loss': nan}",), nan_step=nan_step,
                  health=HealthSeen(rollback=ROLLBACK_ACTION, onset=onset))
    v = judge(obs)
    assert isinstance(v, Crashed) and v.nan_step == nan_step and v.set_aside_from == first


def test_a_stop_carries_the_onset_it_sets_aside_from():
    v = judge(replace(QUIET, **DONE, health=HealthSeen(stop="loss_limit: 50 over 10; stopping", onset=8)))
    assert isinstance(v, HealthStop) and v.set_aside_from == 8
