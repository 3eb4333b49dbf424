"""Watch mode's advice: what `orchestrator run` would do about a verdict, said instead of done.

`advise(what, at)` is the one mapping, pure and table-tested (tests/test_advice.py): a verdict of the RUNNING
pass (loop/running.py), the crash policy's decision once the watched trainer exited, or a checkpoint the content
health checks found unfit to resume from (a supervisor moves it aside: `UnfitCheckpoint`) -> one Advice, or None when
`run` would do nothing (Keep, a completed run, a stop of the watcher itself). Each advice names the command that
acts on it: `orchestrator run RECIPE` resumes from the newest verified checkpoint, the one the advice names.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.loop.running import (Crashed, ExportExited, HealthStop, Keep, ResumedAtWrongStep, RolledBack,
                                       SlowRestart, StopRequested, TrainingOver, Verdict)
from orchestrator.types import Action, CrashClass, Decision

# The metric's action labels (orchestrator_advice_total{action=...}), one per thing `run` would do.
ACTIONS = ("relaunch", "kill_and_relaunch", "wait_for_space", "give_up", "stop", "rollback", "restart", "set_aside")


@dataclass(frozen=True)
class UnfitCheckpoint:
    """A verified checkpoint the content checks found unfit (checkpoint_nonfinite, checkpoint_unchanged)."""

    step: int
    kind: str
    problem: str


@dataclass(frozen=True)
class Exited:
    """The watched trainer ended badly: its verdict and the crash policy's decision on the classified crash."""

    verdict: Crashed
    cls: CrashClass
    decision: Decision
    exit: str                        # "exit 1", "signal 9", or "exit status unknown (not our child)"


@dataclass(frozen=True)
class At:
    """What the advice names: the recipe (for the commands), the trainer, where a relaunch would resume from."""

    recipe: str
    pid: int
    resume: int | None = None        # the newest verified healthy checkpoint's step; None: none yet
    wait: str = "verified"           # supervisor.wait
    wait_s: float = 0.0
    stacks: str | None = None        # a hang: the stacks file
    hung_s: float | None = None      # a hang: seconds since the last step
    nan_step: int | None = None


@dataclass(frozen=True)
class Advice:
    action: str        # one of ACTIONS: the metric's label
    text: str
    command: str

    def line(self) -> str:
        return f"{self.text} (to act: {self.command})"


def _from(at: At) -> str:
    return f"checkpoint-{at.resume}" if at.resume is not None else "the start (no verified checkpoint yet)"


def _wait(at: At) -> str:
    return "after a verified wait" if at.wait == "verified" else f"after a fixed wait of {at.wait_s:g} s"


def advise(what: Verdict | Exited | UnfitCheckpoint, at: At) -> Advice | None:
    """Says what `run` would do about `what` (see the module docstring); None where it would do nothing."""
    run = f"orchestrator run {at.recipe}"
    kill_run = f"kill {at.pid} && {run}"
    match what:
        case Keep() | TrainingOver() | StopRequested() | ExportExited():
            return None
        case UnfitCheckpoint(step=step, problem=problem):
            return Advice("set_aside", f"would set checkpoint-{step} aside: {problem}; the relaunch would resume "
                          f"from {_from(at)}", run)
        case Exited(cls=cls, decision=d, exit=how):
            ended = f"the trainer ended ({how}), classified {cls.value}"
            if d.action is Action.GIVE_UP:
                return Advice("give_up", f"{ended}: would give up: {d.reason}; once the cause is fixed, `run` "
                              f"resumes from {_from(at)}", run)
            if d.action is Action.WAIT_FOR_SPACE:
                return Advice("wait_for_space", f"{ended}: would wait for free space ({d.reason}), then relaunch "
                              f"from {_from(at)}", run)
            aside = (f", setting aside the checkpoints written at or after step {at.nan_step}"
                     if cls is CrashClass.NAN_LOSS and at.nan_step is not None else "")
            return Advice("relaunch", f"{ended}: would relaunch from {_from(at)} {_wait(at)}{aside}", run)
        case Crashed(hang=True):
            minutes = f"{at.hung_s / 60:.0f} min" if at.hung_s is not None else "past its hang timer"
            stacks = f"stacks in {at.stacks}" if at.stacks else "no stacks (py-spy not installed)"
            return Advice("kill_and_relaunch", f"hung for {minutes}: {stacks}; would kill and relaunch from "
                          f"{_from(at)}", kill_run)
        case Crashed(crash=crash) if crash is not None and crash.cls is CrashClass.NAN_LOSS:
            where = f" at step {at.nan_step}" if at.nan_step is not None else ""
            return Advice("kill_and_relaunch", f"loss or grad norm is NaN/Inf{where}: would stop the trainer, set "
                          f"aside the checkpoints written at or after it, and relaunch from {_from(at)}", kill_run)
        case Crashed(crash=crash) if crash is not None and crash.cls is CrashClass.DISK_FULL:
            why = crash.evidence[0] if crash.evidence else "the disk is about to fill"
            return Advice("stop", f"would stop the trainer before it meets ENOSPC ({why}), wait for space, then "
                          f"relaunch from {_from(at)}", kill_run)
        case Crashed():  # an exit is Exited once classified; any other crash the loop saw itself
            return Advice("kill_and_relaunch", f"would stop the trainer and relaunch from {_from(at)}", kill_run)
        case HealthStop(reason=reason):
            return Advice("stop", f"would stop: {reason}", f"kill {at.pid}")
        case RolledBack(action=act):
            return Advice("rollback", f"would stop, set aside the checkpoints from step {act.quarantine_from} on, "
                          f"and relaunch from {_from(at) if act.relaunch_from is None else f'checkpoint-{act.relaunch_from}'}"
                          f": {act.reason}", kill_run)
        case SlowRestart(reason=reason):
            return Advice("restart", f"would restart: {reason}", kill_run)
        case ResumedAtWrongStep(detail=detail):
            return Advice("stop", f"would stop: resumed at the wrong step: {detail}", f"kill {at.pid}")
    raise AssertionError(f"advise: unknown {what!r}")
