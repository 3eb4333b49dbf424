"""The relaunch policy: decide(), next_history(), hang_verdict(), resume_verdict()."""
from __future__ import annotations

import pytest

from orchestrator.domain.policy import (HOUR, History, crashes_last_hour, decide, hang_timeout, hang_verdict,
                                        next_history, resume_verdict)
from orchestrator.config.recipe import SupervisorSection
from orchestrator.host.metrics import RAISED_BY_SUPERVISOR
from orchestrator.types import Action, Alert, Crash, CrashClass

CFG = SupervisorSection()  # wait_s 90, nccl_settle_s 30, 3 crashes/hour, 3 relaunches without progress
NOW = 100_000.0
C = CrashClass
RELAUNCH_PLAIN = [C.COLD_START_OOM, C.FLA_BACKWARD_OOM, C.OOM_DURING_TRAINING, C.HOST_OOM_KILLED, C.CUDA_FATAL,
                  C.NAN_LOSS]


def crash(cls: CrashClass) -> Crash:
    return Crash(cls, ("evidence line",))


# --- one crash, clean history --------------------------------------------------------------------

EXPECTED = {
    C.OTHER: (Action.GIVE_UP, 0.0, False, None),  # OrchestratorGaveUp reads the state, whatever gave up
    C.DISK_FULL: (Action.WAIT_FOR_SPACE, 90.0, False, Alert.DISK_FULL),
    C.PORT_IN_USE: (Action.RELAUNCH, 0.0, True, None),
    C.NCCL_ERROR: (Action.RELAUNCH, 120.0, False, None),
    C.NCCL_TIMEOUT_HANG: (Action.RELAUNCH, 120.0, False, None),
    **{c: (Action.RELAUNCH, 90.0, False, None) for c in RELAUNCH_PLAIN},
}


def test_table_covers_every_class():
    assert set(EXPECTED) == set(CrashClass)


@pytest.mark.parametrize("progress", [True, False])
@pytest.mark.parametrize("cls", list(CrashClass))
def test_decide_first_crash(cls, progress):
    action, wait, new_port, alert = EXPECTED[cls]
    d = decide(crash(cls), History(), CFG, NOW, checkpoint_progress=progress)
    assert (d.action, d.wait_s, d.new_port, d.alert) == (action, wait, new_port, alert)
    assert d.backoff_s == 0.0
    assert d.reason


@pytest.mark.parametrize("cls", list(CrashClass))
def test_decide_custom_waits(cls):
    cfg = SupervisorSection(wait_s=5, nccl_settle_s=7)
    d = decide(crash(cls), History(), cfg, NOW, True)
    if d.action is Action.RELAUNCH and not d.new_port:
        assert d.wait_s == (12 if cls in (C.NCCL_ERROR, C.NCCL_TIMEOUT_HANG) else 5)



@pytest.mark.parametrize("cls", list(CrashClass))
@pytest.mark.parametrize("history", [
    History(),
    History(crash_times=tuple((NOW - 60 * i, C.CUDA_FATAL) for i in range(1, 6))),  # a crash loop
    History(previous_cls=C.NAN_LOSS),
    History(relaunches_without_progress=10),                                       # gives up
], ids=["clean", "crash_loop", "after_nan", "stalled"])
def test_a_decision_carries_only_the_disk_full_alert(cls, history):
    """Crash loop and give-up are Prometheus's to raise (from the counters and the state); the policy
    raises disk_full alone, which only the supervisor can clear (once space is free)."""
    d = decide(crash(cls), history, CFG, NOW, checkpoint_progress=False)
    assert d.alert is (Alert.DISK_FULL if d.action is Action.WAIT_FOR_SPACE else None)
    assert d.alert is None or d.alert in RAISED_BY_SUPERVISOR


# --- nan_loss ------------------------------------------------------------------------------------

@pytest.mark.parametrize("previous,action", [
    (None, Action.RELAUNCH),
    (C.NAN_LOSS, Action.GIVE_UP),
    (C.OOM_DURING_TRAINING, Action.RELAUNCH),
    (C.PORT_IN_USE, Action.RELAUNCH),
])
@pytest.mark.parametrize("progress", [True, False])
def test_nan_loss(previous, action, progress):
    d = decide(crash(C.NAN_LOSS), History(previous_cls=previous), CFG, NOW, progress)
    assert d.action is action
    if action is Action.GIVE_UP:
        assert "nan" in d.reason


@pytest.mark.parametrize("cls", [c for c in CrashClass if c not in (C.NAN_LOSS, C.OTHER)])
def test_previous_nan_does_not_stop_other_classes(cls):
    d = decide(crash(cls), History(previous_cls=C.NAN_LOSS), CFG, NOW, True)
    assert d.action is not Action.GIVE_UP


@pytest.mark.parametrize("history", [History(), History(((NOW - 10, C.OOM_DURING_TRAINING),) * 10, C.OTHER, 0)])
def test_other_always_gives_up(history):
    assert decide(crash(C.OTHER), history, CFG, NOW, True).action is Action.GIVE_UP


# --- crash-loop guard ----------------------------------------------------------------------------

def times(*ages: float, cls: CrashClass = C.OOM_DURING_TRAINING) -> tuple:
    return tuple((NOW - a, cls) for a in ages)


@pytest.mark.parametrize("earlier,cls,loop", [
    (times(), C.OOM_DURING_TRAINING, False),
    (times(10), C.OOM_DURING_TRAINING, False),
    (times(10, 20), C.OOM_DURING_TRAINING, False),
    (times(10, 20, 30), C.OOM_DURING_TRAINING, True),              # the 4th within an hour
    (times(10, 20, 30), C.NCCL_ERROR, True),
    (times(10, 20, 30), C.CUDA_FATAL, True),
    (times(10, 20, 3599), C.OOM_DURING_TRAINING, True),
    (times(10, 20, 3600), C.OOM_DURING_TRAINING, False),           # exactly an hour old: not counted
    (times(10, 20, 7200), C.OOM_DURING_TRAINING, False),
    (times(4000, 5000, 6000, 7000), C.OOM_DURING_TRAINING, False),
    (times(10, 20, 30, cls=C.PORT_IN_USE), C.OOM_DURING_TRAINING, False),  # free retries do not count
    (times(10, 20) + times(30, cls=C.PORT_IN_USE), C.OOM_DURING_TRAINING, False),
    (times(10, 20, 30), C.PORT_IN_USE, False),
    (times(10, 20, 30), C.DISK_FULL, False),                       # waits for space instead
    (times(10, 20, 30, 40, 50), C.COLD_START_OOM, True),
])
def test_crash_loop(earlier, cls, loop):
    d = decide(crash(cls), History(crash_times=earlier), CFG, NOW, checkpoint_progress=True)
    assert (d.backoff_s > 0) is loop
    if loop:
        assert d.action is Action.RELAUNCH and "crashes in the last hour" in d.reason


@pytest.mark.parametrize("n_earlier,backoff", [(3, 180.0), (4, 360.0), (5, 720.0), (6, 1440.0), (7, 1800.0),
                                               (20, 1800.0)])
def test_backoff_grows_and_is_capped(n_earlier, backoff):
    d = decide(crash(C.CUDA_FATAL), History(times(*range(1, n_earlier + 1))), CFG, NOW, True)
    assert d.backoff_s == backoff
    assert d.backoff_s <= CFG.backoff_max_s


def test_backoff_with_zero_wait_is_positive():
    cfg = SupervisorSection(wait_s=0, max_crashes_per_hour=1)
    d = decide(crash(C.CUDA_FATAL), History(times(5)), cfg, NOW, True)
    assert d.backoff_s > 0


@pytest.mark.parametrize("earlier,cls,count", [
    (times(), C.CUDA_FATAL, 1),
    (times(), C.PORT_IN_USE, 0),
    (times(1, 2), C.CUDA_FATAL, 3),
    (times(1, 2, cls=C.PORT_IN_USE), C.CUDA_FATAL, 1),
    (times(1, HOUR, HOUR + 1), C.NCCL_ERROR, 2),
])
def test_crashes_last_hour(earlier, cls, count):
    assert crashes_last_hour(History(earlier), crash(cls), NOW) == count


# --- no checkpoint progress ----------------------------------------------------------------------

@pytest.mark.parametrize("stalled_before,cls,progress,action", [
    (0, C.OOM_DURING_TRAINING, False, Action.RELAUNCH),
    (3, C.OOM_DURING_TRAINING, False, Action.RELAUNCH),
    (4, C.OOM_DURING_TRAINING, False, Action.GIVE_UP),     # the 5th relaunch in a row without progress
    (4, C.NCCL_ERROR, False, Action.GIVE_UP),
    (4, C.NAN_LOSS, False, Action.GIVE_UP),
    (4, C.OOM_DURING_TRAINING, True, Action.RELAUNCH),     # a new good checkpoint resets the count
    (10, C.CUDA_FATAL, True, Action.RELAUNCH),
    (4, C.PORT_IN_USE, False, Action.RELAUNCH),            # port_in_use is not counted
])
def test_no_progress_guard(stalled_before, cls, progress, action):
    d = decide(crash(cls), History(relaunches_without_progress=stalled_before), CFG, NOW, progress)
    assert d.action is action
    if action is Action.GIVE_UP:
        assert "without checkpoint progress" in d.reason


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_simulated_run_without_progress_gives_up_at_limit(limit):
    cfg = SupervisorSection(max_relaunches_without_progress=limit, max_crashes_per_hour=100)
    h, now = History(), NOW
    for n in range(1, 20):  # noqa: B007 - n is the count at the give-up, read after the loop
        c = crash(C.OOM_DURING_TRAINING)
        d = decide(c, h, cfg, now, checkpoint_progress=False)
        if d.action is Action.GIVE_UP:
            break
        h = next_history(h, c, now, checkpoint_progress=False)
        now += 60
    assert n == limit


def test_simulated_port_conflicts_never_give_up():
    h = History()
    for i in range(50):
        c = crash(C.PORT_IN_USE)
        d = decide(c, h, CFG, NOW + i, checkpoint_progress=False)
        assert d.action is Action.RELAUNCH and d.new_port and d.backoff_s == 0
        h = next_history(h, c, NOW + i, checkpoint_progress=False)
    assert h.relaunches_without_progress == 0


# --- next_history --------------------------------------------------------------------------------

@pytest.mark.parametrize("before,cls,progress,after", [
    (0, C.OOM_DURING_TRAINING, False, 1),
    (2, C.OOM_DURING_TRAINING, False, 3),
    (2, C.OOM_DURING_TRAINING, True, 0),
    (2, C.PORT_IN_USE, False, 2),
    (0, C.PORT_IN_USE, True, 0),
    (1, C.DISK_FULL, False, 2),
])
def test_next_history_stalled(before, cls, progress, after):
    h = next_history(History(relaunches_without_progress=before), crash(cls), NOW, progress)
    assert h.relaunches_without_progress == after
    assert h.previous_cls is cls
    assert h.crash_times[-1] == (NOW, cls)


def test_next_history_drops_old_crashes():
    old = History(crash_times=times(5000, 3600, 3599, 10))
    h = next_history(old, crash(C.NCCL_ERROR), NOW, True)
    assert h.crash_times == times(3599, 10) + ((NOW, C.NCCL_ERROR),)
    assert old.crash_times == times(5000, 3600, 3599, 10), "History is immutable"


def test_next_history_then_nan_twice():
    h = next_history(History(), crash(C.NAN_LOSS), NOW, True)
    assert decide(crash(C.NAN_LOSS), h, CFG, NOW + 1, True).action is Action.GIVE_UP
    h2 = next_history(h, crash(C.CUDA_FATAL), NOW + 2, True)
    assert decide(crash(C.NAN_LOSS), h2, CFG, NOW + 3, True).action is Action.RELAUNCH


# --- hang_verdict --------------------------------------------------------------------------------

@pytest.mark.parametrize("now,launched,last_step,hang,fragment", [
    (100, 0, None, None, None),                  # starting up, within startup_timeout_s
    (3600, 0, None, None, None),                 # exactly the startup timeout: not yet
    (3601, 0, None, "startup", "startup_timeout_s = 3600"),
    (10_000, 0, None, "startup", "startup_timeout_s"),
    (3601, 0, 3000, None, None),                 # training: the step clock applies, not startup
    (4800, 0, 3000, None, None),                 # exactly hang_timeout_s since the last step
    (4801, 0, 3000, "hang", "hang timer 1800 s"),
    (10_000, 9_000, 9_500, None, None),
    (100_000, 0, 10, "hang", "no new training step"),
])
def test_hang_verdict(now, launched, last_step, hang, fragment):
    v = hang_verdict(now, launched, last_step, hang_timeout_s=1800, startup_timeout_s=3600)
    if hang is None:
        assert v is None
    else:
        assert v is not None and fragment in v


def test_hang_verdict_startup_longer_than_hang():
    # 2000 s after launch without a step is fine at startup, a hang once training has started
    assert hang_verdict(2000, 0, None, 1800, 3600) is None
    assert hang_verdict(2000, 0, 100, 1800, 3600) is not None


# --- hang_timeout -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, bound, floor, gap, gaps, saves, timer, fragment", [
    ("adaptive", 1800, 300, 20.0, 50, 2, 300, "hang_floor_s = 300"),   # 5 x 20 s = 100 s: the floor
    ("adaptive", 1800, 300, 90.0, 50, 2, 450, "5 x the longest step gap"),
    ("adaptive", 1800, 300, 400.0, 50, 2, 1800, "hang_timeout_s = 1800"),  # never above the bound
    ("adaptive", 1800, 300, 20.0, 9, 2, 1800, "9 gaps"),    # too few gaps: the bound
    ("adaptive", 1800, 300, 20.0, 50, 0, 1800, "0 saves"),  # no save lived through: the bound
    ("adaptive", 200, 300, 20.0, 50, 2, 200, ""),           # a bound below the floor wins
    ("fixed", 1800, 300, 20.0, 50, 2, 1800, "fixed"),
])
def test_hang_timeout(mode, bound, floor, gap, gaps, saves, timer, fragment):
    cfg = SupervisorSection(hang=mode, hang_timeout_s=bound, hang_floor_s=floor)
    t, why = hang_timeout(cfg, gap, gaps, saves)
    assert t == timer and fragment in why
    # evaluations on their own schedule (extra_args.eval_steps): not in the pace, the bound throughout
    assert hang_timeout(cfg, gap, gaps, saves, evals_apart=True)[0] == bound


# --- resume_verdict ------------------------------------------------------------------------------

@pytest.mark.parametrize("resume_step,first_step,logging_steps,ok", [
    (100, 101, 1, True),
    (100, 100, 1, False),        # the checkpoint's own step again: not resumed
    (100, 102, 1, False),        # skipped a step
    (100, 1, 1, False),          # started from scratch
    (100, 105, 5, True),
    (100, 106, 5, False),
    (102, 105, 5, True),         # save_steps not a multiple of logging_steps
])
def test_resume_verdict(resume_step, first_step, logging_steps, ok):
    v = resume_verdict(resume_step, first_step, logging_steps)
    assert (v is None) is ok, v
    if not ok:
        assert str(first_step) in v


# --- disk_full on /dev/shm -----------------------------------------------------------------------

BUS = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error."
NCCL_SHM = "NCCL WARN Error while creating shared memory segment /dev/shm/nccl-7Ysd0 (size 9637888)"


@pytest.mark.parametrize("evidence, shm_total_gib, action, fragment", [
    ((BUS,), 0.0625, Action.GIVE_UP, "only 64 MiB in all: waiting cannot help; start the container with --ipc=host"),
    ((NCCL_SHM,), 0.5, Action.GIVE_UP, "only 512 MiB in all"),
    ((BUS,), 16.0, Action.WAIT_FOR_SPACE, "/dev/shm exhausted: waiting for 1 GiB of shared memory"),
    ((BUS,), None, Action.WAIT_FOR_SPACE, "/dev/shm exhausted"),
    # output_dir was full at the crash too: that disk is the one to wait for
    (("disk full at the crash: /out has 0.001 GiB free", BUS), 0.0625, Action.WAIT_FOR_SPACE, "disk full: waiting"),
    (("OSError: [Errno 28] No space left on device",), 0.0625, Action.WAIT_FOR_SPACE, "disk full: waiting"),
], ids=["docker_default", "half_gib", "big_but_full", "size_unknown", "output_dir_full_too", "output_dir"])
def test_disk_full_on_dev_shm(evidence, shm_total_gib, action, fragment):
    d = decide(Crash(C.DISK_FULL, evidence), History(), CFG, NOW, False, shm_total_gib)
    assert d.action is action and fragment in d.reason, d
    assert d.alert is (Alert.DISK_FULL if action is Action.WAIT_FOR_SPACE else None)
