"""What to do about a health finding (orchestrator/domain/health/action.py): warn / stop / rollback per
health.on_divergence, the recurrence rule, and the resume_divergence relaunch-once rule."""
from __future__ import annotations

import pytest

from orchestrator.domain.health.kinds import Finding
from orchestrator.types import HealthKind
from orchestrator.domain.health.action import HealthAction, Rollback, decide, decide_resume, newest_before, recurrence, rollbacks_of

VERIFIED = [10, 20, 30, 40, 50, 60]


def finding(kind: str = HealthKind.LOSS_DIVERGENCE, first: int | None = 35, last: int | None = 55) -> Finding:
    return Finding(kind, "the loss level is 2.5, over 2.1", first, last, 20, 1.42, 2.1, 2.5)


@pytest.mark.parametrize("kind", [HealthKind.LOSS_SPIKE, HealthKind.GRAD_NORM_SPIKE, HealthKind.PROGRESS_UNREADABLE, HealthKind.THROUGHPUT_DROP])
@pytest.mark.parametrize("on_divergence", ["stop", "rollback", "warn"])
def test_warn_only_kinds_warn_whatever_the_recipe_says(kind, on_divergence):
    a = decide(finding(kind), on_divergence, VERIFIED)
    assert (a.action, a.relaunch_from, a.quarantine_from) == ("warn", None, None)


@pytest.mark.parametrize("kind", [HealthKind.LOSS_DIVERGENCE, HealthKind.LOSS_LIMIT, HealthKind.GRAD_NORM_LIMIT])
@pytest.mark.parametrize("on_divergence,action,relaunch_from,quarantine_from", [
    ("stop", "stop", None, None),
    ("warn", "warn", None, None),
    ("rollback", "rollback", 30, 35),   # the newest verified checkpoint before the onset (35)
])
def test_divergence_kinds_follow_on_divergence(kind, on_divergence, action, relaunch_from, quarantine_from):
    a = decide(finding(kind), on_divergence, VERIFIED)
    assert (a.action, a.relaunch_from, a.quarantine_from) == (action, relaunch_from, quarantine_from)
    assert kind in a.reason


def test_stop_says_checkpoints_are_kept():
    assert "checkpoints kept" in decide(finding(), "stop", VERIFIED).reason


@pytest.mark.parametrize("first,last,target", [
    (35, 55, 30),
    (30, 55, 20),     # a checkpoint saved at the onset step holds the onset's update: quarantined too
    (11, 30, 10),
])
def test_rollback_goes_to_the_newest_verified_checkpoint_before_the_onset(first, last, target):
    a = decide(finding(first=first, last=last), "rollback", VERIFIED)
    assert (a.action, a.relaunch_from, a.quarantine_from) == ("rollback", target, first)


def test_rollback_without_a_verified_checkpoint_before_the_onset_stops():
    a = decide(finding(first=8, last=30), "rollback", VERIFIED)
    assert a.action == "stop" and "no verified checkpoint before the onset at step 8" in a.reason


@pytest.mark.parametrize("earlier,first,last,recurs", [
    ([Rollback(35, 55, 30)], 40, 60, True),    # the same steps again
    ([Rollback(35, 55, 30)], 31, 50, True),    # earlier onset, still after the checkpoint rolled back to
    ([Rollback(35, 55, 30)], 56, 80, False),   # past where it was found: a new symptom
    ([Rollback(35, 55, 30)], 120, 140, False),
    ([Rollback(35, 55, 30), Rollback(135, 150, 130)], 140, 160, True),
    ([], 40, 60, False),
])
def test_the_same_symptom_again_within_the_rolled_back_range_stops(earlier, first, last, recurs):
    a = decide(finding(first=first, last=last), "rollback", VERIFIED + [130], earlier)
    assert (a.action == "stop") is recurs
    assert (recurrence(finding(first=first, last=last), earlier) is not None) is recurs
    if recurs:
        assert "same symptom again" in a.reason and "data" in a.reason


def test_rollbacks_are_read_back_from_the_journal_events():
    rollback = decide(finding(first=35, last=55), "rollback", VERIFIED)
    events = [
        {"kind": HealthKind.LOSS_DIVERGENCE, "message": "m", "data": finding(first=35, last=55).record() | rollback.record()},
        {"kind": HealthKind.LOSS_SPIKE, "message": "m", "data": {"first_step": 3, "last_step": 3, "action": "warn"}},
        {"kind": HealthKind.LOSS_LIMIT, "message": "m", "data": {"first_step": 70, "last_step": 70, "action": "stop"}},
        {"kind": "launch", "message": "m", "data": {}},
    ]
    assert rollbacks_of(events) == [Rollback(35, 55, 30)]
    again = decide(finding(first=40, last=58), "rollback", VERIFIED, rollbacks_of(events))
    assert again.action == "stop"


@pytest.mark.parametrize("resumed_from,retrying,action,relaunch_from", [
    (40, False, "rollback", 30),   # quarantine checkpoint-40 (and what the attempt saved since), relaunch from 30
    (40, True, "stop", None),      # the relaunch from the one before diverged too: the resume path is broken
    (10, False, "stop", None),     # nothing verified before the suspect checkpoint
])
def test_resume_divergence_relaunches_once_from_the_checkpoint_before(resumed_from, retrying, action, relaunch_from):
    a = decide_resume(finding(HealthKind.RESUME_DIVERGENCE, resumed_from + 1, resumed_from + 10), resumed_from, VERIFIED,
                      retrying)
    assert (a.action, a.relaunch_from) == (action, relaunch_from)
    assert a.quarantine_from == (resumed_from if action == "rollback" else None)
    if retrying:
        assert "resume path itself is broken" in a.reason


def test_newest_before():
    assert (newest_before(35, VERIFIED), newest_before(10, VERIFIED), newest_before(100, [])) == (30, None, None)


def test_action_record():
    assert HealthAction("rollback", "r", 30, 35).record() == {"action": "rollback", "relaunch_from": 30,
                                                              "quarantine_from": 35}
    assert HealthAction("warn", "r").record() == {"action": "warn"}
