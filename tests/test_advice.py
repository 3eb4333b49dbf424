"""advise(): every verdict of the RUNNING pass, an ended trainer's decision and an unfit checkpoint -> what
`run` would do, said (orchestrator/loop/advice.py)."""
from __future__ import annotations

import pytest

from orchestrator.domain.health.action import HealthAction
from orchestrator.loop.advice import ACTIONS, At, Exited, UnfitCheckpoint, advise
from orchestrator.loop.running import (Crashed, ExportExited, HealthStop, Keep, ResumedAtWrongStep, RolledBack,
                                       SlowRestart, StopRequested, TrainingOver)
from orchestrator.types import Action, Crash, CrashClass, Decision

AT = At("r.toml", 4242, resume=1200, wait="verified", wait_s=90)
RUN, KILL_RUN = "orchestrator run r.toml", "kill 4242 && orchestrator run r.toml"


def exited(cls: CrashClass, action: Action, reason: str = "why") -> Exited:
    return Exited(Crashed(), cls, Decision(action, reason), "signal 9")


CASES = {
    "relaunch after a crash": (exited(CrashClass.HOST_OOM_KILLED, Action.RELAUNCH), AT, "relaunch",
                               "would relaunch from checkpoint-1200 after a verified wait", RUN),
    "a fixed wait": (exited(CrashClass.NCCL_ERROR, Action.RELAUNCH), At("r.toml", 4242, 1200, "fixed", 90),
                     "relaunch", "would relaunch from checkpoint-1200 after a fixed wait of 90 s", RUN),
    "no checkpoint yet": (exited(CrashClass.NCCL_ERROR, Action.RELAUNCH), At("r.toml", 4242), "relaunch",
                          "would relaunch from the start (no verified checkpoint yet)", RUN),
    "give up": (exited(CrashClass.OTHER, Action.GIVE_UP, "class `other`: retrying cannot help"), AT, "give_up",
                "would give up: class `other`: retrying cannot help", RUN),
    "wait for space": (exited(CrashClass.DISK_FULL, Action.WAIT_FOR_SPACE), AT, "wait_for_space",
                       "would wait for free space", RUN),
    "a NaN's relaunch sets aside": (exited(CrashClass.NAN_LOSS, Action.RELAUNCH),
                                    At("r.toml", 4242, 1200, nan_step=1250), "relaunch",
                                    "setting aside the checkpoints written at or after step 1250", RUN),
    "hang": (Crashed(Crash(CrashClass.NCCL_TIMEOUT_HANG), hang=True),
             At("r.toml", 4242, 1200, stacks="/o/stacks-0003.txt", hung_s=2400), "kill_and_relaunch",
             "hung for 40 min: stacks in /o/stacks-0003.txt; would kill and relaunch from checkpoint-1200", KILL_RUN),
    "hang without py-spy": (Crashed(Crash(CrashClass.NCCL_TIMEOUT_HANG), hang=True), AT, "kill_and_relaunch",
                            "no stacks (py-spy not installed)", KILL_RUN),
    "NaN while running": (Crashed(Crash(CrashClass.NAN_LOSS), nan_step=1250), At("r.toml", 4242, 1200, nan_step=1250),
                          "kill_and_relaunch", "NaN/Inf at step 1250: would stop the trainer", KILL_RUN),
    "disk about to fill": (Crashed(Crash(CrashClass.DISK_FULL, ("/o: 1 GiB free",))), AT, "stop",
                           "before it meets ENOSPC (/o: 1 GiB free)", KILL_RUN),
    "health stop": (HealthStop("loss over the limit since step 18,400"), AT, "stop",
                    "would stop: loss over the limit since step 18,400", "kill 4242"),
    "rollback": (RolledBack(HealthAction("rollback", "loss spike", relaunch_from=1100, quarantine_from=1150)), AT,
                 "rollback", "from step 1150 on, and relaunch from checkpoint-1100: loss spike", KILL_RUN),
    "slow restart": (SlowRestart("0.5x the baseline"), AT, "restart", "would restart: 0.5x the baseline", KILL_RUN),
    "resumed at the wrong step": (ResumedAtWrongStep("step 7 after 10"), AT, "stop", "resumed at the wrong step: step 7 after 10",
                          "kill 4242"),
    "a stale checkpoint": (UnfitCheckpoint(1300, "checkpoint_unchanged", "its weights are checkpoint-1200's"), AT,
                           "set_aside", "would set checkpoint-1300 aside: its weights are checkpoint-1200's", RUN),
    "a non-finite checkpoint": (UnfitCheckpoint(1300, "checkpoint_nonfinite", "it holds NaN"), AT, "set_aside",
                                "would set checkpoint-1300 aside: it holds NaN", RUN),
}


@pytest.mark.parametrize("what,at,action,text,command", CASES.values(), ids=CASES.keys())
def test_each_verdict_is_advised_with_the_command_that_acts_on_it(what, at, action, text, command):
    adv = advise(what, at)
    assert adv is not None and adv.action == action and text in adv.text and adv.command == command
    assert adv.action in ACTIONS and command in adv.line()


@pytest.mark.parametrize("what", [Keep(), TrainingOver(), TrainingOver("exit 1 after its last step"),
                                  StopRequested(), ExportExited()])
def test_nothing_is_advised_where_run_would_do_nothing(what):
    assert advise(what, AT) is None
