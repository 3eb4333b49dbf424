"""What to do about a finished or stuck attempt. Pure functions of data; table-tested.

Per-class actions (the field procedure, made explicit):
  port_in_use        relaunch at once on a fresh port; not counted against the crash budget
  nccl_*             relaunch after wait_s + nccl_settle_s (NCCL IPC handles need time to go)
  disk_full          no blind restart: wait for free space, raising the disk_full alert meanwhile; an
                     exhausted /dev/shm smaller than SHM_MIN_GIB in all: give up (only a new container helps)
  other              give up: a bad argument or an import error does not fix itself
  nan_loss           relaunch once from the last good checkpoint; twice in a row: give up
  everything else    relaunch after wait_s
Guards: more than max_crashes_per_hour → exponential backoff (OrchestratorCrashLoop fires on the same count);
max_relaunches_without_progress relaunches in a row with no new good checkpoint → give up (exit 3).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.config.schema import SupervisorSection
from orchestrator.domain.crash_rules import SHM_PATTERNS
from orchestrator.domain.verdict import DISK_FULL_AT_CRASH
from orchestrator.types import Action, Alert, Attempt, Crash, CrashClass, Decision

HOUR = 3600.0
# Failures that say nothing about the training's health: they do not count toward the crash loop.
_FREE_RETRIES = frozenset({CrashClass.PORT_IN_USE})
_NCCL = frozenset({CrashClass.NCCL_ERROR, CrashClass.NCCL_TIMEOUT_HANG})
# NCCL's troubleshooting guide asks containers for --shm-size=1g at least; Docker's default is 64 MiB.
SHM_MIN_GIB = 1.0
_SHM = re.compile("|".join(SHM_PATTERNS), re.IGNORECASE)
SHM_FIX = "start the container with --ipc=host or --shm-size=16g (or lower data.dataloader_num_workers)"


@dataclass(frozen=True)
class History:
    crash_times: tuple[tuple[float, CrashClass], ...] = ()   # earlier crashes (time, class)
    previous_cls: CrashClass | None = None                   # class of the attempt before this one
    relaunches_without_progress: int = 0                     # in a row, before this crash


def crashes_last_hour(history: History, crash: Crash, now: float) -> int:
    earlier = sum(1 for t, c in history.crash_times if now - t < HOUR and c not in _FREE_RETRIES)
    return earlier + (crash.cls not in _FREE_RETRIES)


def shared_memory_full(crash: Crash) -> bool:
    """Tells whether a disk_full crash is /dev/shm's (its evidence names shared memory) rather than output_dir's."""
    return (crash.cls is CrashClass.DISK_FULL and any(_SHM.search(e) for e in crash.evidence)
            and not any(e.startswith(DISK_FULL_AT_CRASH) for e in crash.evidence))


def decide(crash: Crash, history: History, cfg: SupervisorSection, now: float, checkpoint_progress: bool,
           shm_total_gib: float | None = None) -> Decision:
    """Decides what to do about a crash. `checkpoint_progress`: a newer good checkpoint exists than when this
    attempt was launched; `shm_total_gib`: the size of /dev/shm, when known."""
    cls = crash.cls
    if cls is CrashClass.OTHER:
        return Decision(Action.GIVE_UP, "class `other`: retrying cannot help (see the evidence)")
    if cls is CrashClass.NAN_LOSS and history.previous_cls is CrashClass.NAN_LOSS:
        return Decision(Action.GIVE_UP, "nan_loss twice in a row from the same checkpoint")
    stalled = 0 if checkpoint_progress else history.relaunches_without_progress + (cls not in _FREE_RETRIES)
    if stalled >= cfg.max_relaunches_without_progress:
        return Decision(Action.GIVE_UP, f"{stalled} relaunches in a row without checkpoint progress")
    if shared_memory_full(crash):
        if shm_total_gib is not None and shm_total_gib < SHM_MIN_GIB:
            return Decision(Action.GIVE_UP, f"/dev/shm exhausted and only {shm_total_gib * 1024:.0f} MiB in all: waiting "
                            f"cannot help; {SHM_FIX}, then run again")
        return Decision(Action.WAIT_FOR_SPACE, f"/dev/shm exhausted: waiting for {SHM_MIN_GIB:g} GiB of shared memory "
                        "before relaunching", wait_s=cfg.wait_s, alert=Alert.DISK_FULL)
    if cls is CrashClass.DISK_FULL:
        return Decision(Action.WAIT_FOR_SPACE, "disk full: waiting for free space before relaunching",
                        wait_s=cfg.wait_s, alert=Alert.DISK_FULL)
    if cls in _FREE_RETRIES:
        return Decision(Action.RELAUNCH, "rendezvous port taken: relaunch on a fresh port", new_port=True)
    wait = cfg.wait_s + (cfg.nccl_settle_s if cls in _NCCL else 0.0)
    count = crashes_last_hour(history, crash, now)
    if count > cfg.max_crashes_per_hour:
        backoff = min(cfg.backoff_max_s, max(cfg.wait_s, 1.0) * 2 ** (count - cfg.max_crashes_per_hour))
        return Decision(Action.RELAUNCH, f"{count} crashes in the last hour (limit {cfg.max_crashes_per_hour}): "
                        f"backing off {backoff:.0f} s", wait_s=wait, backoff_s=backoff)
    return Decision(Action.RELAUNCH, f"{cls.value}: relaunch from the newest good checkpoint", wait_s=wait)


def next_history(history: History, crash: Crash, now: float, checkpoint_progress: bool) -> History:
    stalled = 0 if checkpoint_progress else history.relaunches_without_progress + (crash.cls not in _FREE_RETRIES)
    recent = tuple((t, c) for t, c in history.crash_times if now - t < HOUR) + ((now, crash.cls),)
    return History(recent, crash.cls, stalled)


def rebuild_history(attempts: list[Attempt], good_steps: set[int]) -> History:
    """The history a supervisor restarted mid-run continues from: every ended attempt that crashed,
    in order, as the live loop folded it. An attempt progressed when a good checkpoint exists past
    its resume point and no later than its last step. Stopped and interrupted attempts (no class)
    say nothing about the training's health and are skipped."""
    h = History()
    for a in attempts:
        if a.ended_at is None or a.cls is None:
            continue
        start, end = a.start_step or 0, a.end_step if a.end_step is not None else float("inf")
        progressed = any(start < s <= end for s in good_steps)
        h = next_history(h, Crash(a.cls), a.ended_at, progressed)
    return h


# Adaptive hang timer (supervisor.hang = "adaptive"): NVRx's learned timeouts, per attempt. Its safety factor.
HANG_SAFETY = 5.0
HANG_MIN_GAPS = 10   # step-to-step gaps an attempt must show before its own pace sets the timer


def hang_timeout(cfg: SupervisorSection, longest_gap_s: float, gaps: int, saves: int,
                 evals_apart: bool = False) -> tuple[float, str]:
    """The hang timer for the running attempt, and why. "adaptive": HANG_SAFETY x the longest gap between two
    step records the attempt has shown (a save, an evaluation, a slow logging interval are in it), clamped to
    [hang_floor_s, hang_timeout_s], once it has shown HANG_MIN_GAPS gaps and lived through a save (the longest
    regular pause); until then, and for "fixed", hang_timeout_s. A hang then costs minutes, not half an hour.
    `evals_apart`: the recipe evaluates on its own schedule (extra_args.eval_steps), so a save is not where
    the longest pause shows: hang_timeout_s (ms-swift evaluates at every save by default)."""
    bound = cfg.hang_timeout_s
    if cfg.hang == "fixed":
        return bound, "hang = fixed"
    if evals_apart:
        return bound, "hang_timeout_s: extra_args.eval_steps evaluates apart from saves (not in the attempt's pace)"
    if gaps < HANG_MIN_GAPS or saves < 1:
        return bound, (f"hang_timeout_s until the attempt shows {HANG_MIN_GAPS} step gaps and a save "
                       f"({gaps} gaps, {saves} saves so far)")
    t = min(bound, max(cfg.hang_floor_s, HANG_SAFETY * longest_gap_s))
    return t, (f"{HANG_SAFETY:g} x the longest step gap of this attempt ({longest_gap_s:.0f} s over {gaps} gaps, "
               f"{saves} saves) within [hang_floor_s = {cfg.hang_floor_s:.0f}, hang_timeout_s = {bound:.0f}]")


def hang_verdict(now: float, launched_at: float, last_step_at: float | None,
                 hang_timeout_s: float, startup_timeout_s: float) -> str | None:
    """No new step for hang_timeout_s once training started, or none for startup_timeout_s."""
    if last_step_at is None:
        if now - launched_at > startup_timeout_s:
            return f"no training step within startup_timeout_s = {startup_timeout_s:.0f} s of launch"
        return None
    if now - last_step_at > hang_timeout_s:
        return f"no new training step for {now - last_step_at:.0f} s (hang timer {hang_timeout_s:.0f} s)"
    return None


def resume_verdict(resume_step: int, first_step: int, logging_steps: int) -> str | None:
    """Checks that after a resume from checkpoint N the first logged step lies in (N, N + logging_steps]. The
    resumed losses are run health's to judge (domain/health/resume.py)."""
    if not resume_step < first_step <= resume_step + logging_steps:
        return f"resumed from step {resume_step} but the first logged step is {first_step}"
    return None


READY_POLL_S = 0.25   # how often a verified wait looks again: a relaunch is late by at most this


@dataclass(frozen=True)
class Readiness:
    go: bool                    # relaunch now (all clear past the floor, or the upper bound reached)
    waiting_for: tuple[str, ...]  # what is not clear yet (at go: what the bound cut short, if anything)
    recheck_s: float = 0.0      # when not go: look again after this long


def settle_floor(cls: CrashClass, cfg: SupervisorSection) -> float:
    """The minimum wait of a verified wait: nccl_settle_s after nccl_* classes (CUDA IPC handles
    held in a peer's driver state are not visible to any check), none otherwise."""
    return cfg.nccl_settle_s if cls in _NCCL else 0.0


def readiness_verdict(elapsed_s: float, floor_s: float, bound_s: float, leftovers: list[int],
                      gpu_problems: list[str], shm_held: dict[str, list[int]], port_free: bool) -> Readiness:
    """May the next attempt start? What the field's fixed 90 s guesses at, checked: every process
    of the run gone (re-parented ones included), GPU memory released on the run's GPUs, the run's
    NCCL shared-memory segments unmapped, a free rendezvous port; and at least `floor_s` waited.
    Never longer than `bound_s` (supervisor.wait_s, + nccl_settle_s): VERIFYING still refuses busy GPUs
    and the launch still takes only a free port."""
    blocking = ([f"{len(leftovers)} process(es) of the run still alive (pids {', '.join(map(str, leftovers[:5]))})"]
                if leftovers else [])
    blocking += [f"GPU: {p}" for p in gpu_problems]
    blocking += [f"shm {name} still mapped by pid {', '.join(map(str, pids))}" for name, pids in sorted(shm_held.items())]
    blocking += [] if port_free else ["no free rendezvous port in port_range"]
    if elapsed_s >= bound_s:
        return Readiness(True, tuple(blocking))
    if not blocking and elapsed_s >= floor_s:
        return Readiness(True, ())
    left = bound_s - elapsed_s
    if not blocking:  # only the floor holds it back: wake exactly at the floor
        return Readiness(False, (f"nccl settle floor {floor_s:g} s",), min(floor_s - elapsed_s, left))
    return Readiness(False, tuple(blocking), min(READY_POLL_S, left))
