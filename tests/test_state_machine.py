"""The supervisor's state machine, table-tested: for each state and event, the next state and the host
calls made. No processes and no real time: an in-memory host (tests/support/fake_host.py) with a fake clock;
files (journal, logs, checkpoints) are real, in tmp_path."""
from __future__ import annotations


import pytest

from fake_host import FakeHost
from loop_world import MAX, OOM, crashed, drive, journal, running
from orchestrator.types import Action, Crash, CrashClass, ExitCode, State


# --- PREFLIGHT ------------------------------------------------------------------------------------
def test_preflight_checks_gpus_and_leftovers_then_verifies(world):
    sup, host = world()
    assert sup.step() is State.VERIFYING
    assert host.names()[:1] == ["gpu_snapshot"] and "launch" not in host.names()


def test_preflight_stops_a_predecessors_leftovers(world):
    sup, host = world()
    host.leftover_pids = [777]
    sup.step()
    assert ("terminate", ()) in host.calls, "leftovers of this run are stopped before anything launches"


def test_preflight_of_a_completed_run_launches_nothing(world):
    sup, host = world()
    t = running(sup, host)
    t.steps(1, MAX, MAX)
    t.exit(code=0)
    assert sup.step() is State.COMPLETED
    sup.shutdown()
    again, host2 = world()
    assert again.step() is State.COMPLETED and "launch" not in host2.names()


# --- VERIFYING ------------------------------------------------------------------------------------
@pytest.mark.parametrize("holders, cmdlines, patterns, next_state, killed", [
    ({}, {}, [], State.LAUNCHING, None),                                        # clear
    ({0: [500]}, {500: "python train.py"}, [], State.VERIFYING, None),         # foreign holder: spared, retry
    ({0: [500]}, {500: "python stale_eval.py"}, ["stale_eval"], State.LAUNCHING, (500,)),  # allowed by pattern
    ({3: [600]}, {}, [], State.LAUNCHING, (600,)),                              # our own leftover
])
def test_verifying(world, holders, cmdlines, patterns, next_state, killed):
    sup, host = world(gpu={"kill_patterns": patterns})
    drive(sup, State.VERIFYING)
    host.holders, host.cmdlines = holders, cmdlines
    if 600 in cmdlines or {3: [600]} == holders:
        host.leftover_pids = [600]
    host.calls.clear()
    assert sup.step() is next_state
    kills = [c[1] for c in host.calls if c[0] == "kill"]
    if killed is None:
        assert all(not k for k in kills), f"never kill a foreign holder: {kills}"
        if next_state is State.VERIFYING:
            assert sup.parts.recovery.gpu_backoff_s > 0 and "launch" not in host.names()
    else:
        assert kills == [killed]
        assert ("wait", 1.0) in host.calls, "force_wait_s before checking again"


def test_verifying_with_a_stop_requested_stops(world):
    sup, host = world()
    drive(sup, State.VERIFYING)
    sup.request_stop("test")
    assert sup.step() is State.STOPPED and "launch" not in host.names()


# --- LAUNCHING ------------------------------------------------------------------------------------
def test_launch_records_the_row_and_starts_the_trainer(world):
    sup, host = world()
    drive(sup, State.LAUNCHING)
    assert sup.step() is State.RUNNING
    t = host.trainers[0]
    assert t.cmd.env.get("MASTER_PORT") == "29500"
    row = journal(sup).last_attempt()
    assert row.n == 1 and row.pid == t.pid and row.port == 29500 and row.start_step == 0


def test_launch_without_a_free_port_waits_and_verifies_again(world):
    sup, host = world()
    drive(sup, State.LAUNCHING)
    host.taken_ports = set(range(29500, 29510))
    assert sup.step() is State.VERIFYING and "launch" not in host.names()
    assert ("wait", 1.0) in host.calls


# --- RUNNING --------------------------------------------------------------------------------------
def _exit_ok(sup, host, t):
    t.steps(1, MAX, MAX)
    t.exit(code=0)


def _exit_0_early(sup, host, t):
    t.steps(1, 4, MAX)
    t.exit(code=0)


def _oom(sup, host, t):
    t.steps(1, 4, MAX)
    t.write(OOM)
    t.exit(code=1)


def _killed(sup, host, t):
    t.steps(1, 4, MAX)
    t.exit(signal=9)


def _nan(sup, host, t):
    t.steps(1, 3, MAX)
    t.write(str({"loss": "nan", "grad_norm": "nan", "global_step/max_steps": f"4/{MAX}"}))


def _silent(sup, host, t):
    t.steps(1, 2, MAX)
    sup.step()                     # sees step 2
    host.mono += 601               # then nothing for longer than hang_timeout_s


def _silent_while_saving(sup, host, t):
    _silent(sup, host, t)
    host.last_write = host.now() - 10   # but a checkpoint file was written 10 s ago: a long save, not a hang


def _silent_after_a_save(sup, host, t):
    _silent(sup, host, t)
    host.last_write = host.now() - 700  # the last write is older than hang_timeout_s too


def _no_first_step(sup, host, t):
    host.mono += 1801              # startup_timeout_s without a step


def _stop(sup, host, t):
    t.steps(1, 2, MAX)
    sup.request_stop("operator")


def _progressing(sup, host, t):
    t.steps(1, 3, MAX)


@pytest.mark.parametrize("event, next_state, cls, calls", [
    (_exit_ok, State.COMPLETED, None, []),
    (_exit_0_early, State.CRASHED, CrashClass.OTHER, []),
    (_oom, State.CRASHED, CrashClass.OOM_DURING_TRAINING, []),
    (_killed, State.CRASHED, CrashClass.HOST_OOM_KILLED, []),
    (_nan, State.CRASHED, CrashClass.NAN_LOSS, []),
    (_silent, State.CRASHED, CrashClass.NCCL_TIMEOUT_HANG, ["dump_stacks"]),
    (_silent_while_saving, State.RUNNING, None, ["newest_write"]),
    (_silent_after_a_save, State.CRASHED, CrashClass.NCCL_TIMEOUT_HANG, ["dump_stacks"]),
    (_no_first_step, State.CRASHED, CrashClass.NCCL_TIMEOUT_HANG, ["dump_stacks"]),
    (_stop, State.STOPPING, None, []),
    (_progressing, State.RUNNING, None, []),
], ids=lambda v: getattr(v, "__name__", None))
def test_running(world, event, next_state, cls, calls):
    sup, host = world()
    t = running(sup, host)
    event(sup, host, t)
    host.calls.clear()
    assert sup.step() is next_state
    if cls is not None:
        assert sup.attempt.crash.cls is cls, sup.attempt.crash
    for name in calls:
        assert name in host.names()
    assert "terminate" not in host.names(), "RUNNING only watches; cleaning is its own state"


def test_startup_oom_is_cold_start(world):
    sup, host = world()
    t = running(sup, host)
    t.write(OOM)
    t.exit(code=1)
    assert sup.step() is State.CRASHED and sup.attempt.crash.cls is CrashClass.COLD_START_OOM


def test_hang_is_measured_on_the_monotonic_clock(world):
    """A wall-clock jump (NTP step) is not a hang: only monotonic time counts."""
    import fake_host

    sup, host = world()
    t = running(sup, host)
    t.steps(1, 2, MAX)
    sup.step()
    fake_host.T0 += 10_000
    try:
        assert sup.step() is State.RUNNING
    finally:
        fake_host.T0 -= 10_000


def _paced(sup, host, t, steps: int = 12, save_at: int = 5) -> None:
    """Steps every 20 s, one save (at `save_at`) pausing training 40 s more."""
    for s in range(1, steps + 1):
        t.steps(s, s, 40)
        assert sup.step() is State.RUNNING
        host.mono += 20 + (40 if s == save_at else 0)


@pytest.mark.parametrize("hang, save_steps, quiet_s, next_state", [
    ("adaptive", 5, 320, State.CRASHED),    # 5 x the longest gap (~60 s) = ~300 s: a hang after 320 s
    ("adaptive", 5, 250, State.RUNNING),    # under the timer
    ("adaptive", 100, 320, State.RUNNING),  # no save lived through yet: hang_timeout_s (3600) still applies
    ("fixed", 5, 320, State.RUNNING),       # the field's timer: hang_timeout_s throughout
    ("fixed", 5, 3601, State.CRASHED),
])
def test_adaptive_hang_timer(world, hang, save_steps, quiet_s, next_state):
    """Once an attempt has shown its pace (10 step gaps and a save), no new step for 5 x its longest gap
    (at least hang_floor_s) is a hang: minutes, not hang_timeout_s."""
    sup, host = world(supervisor={"hang_timeout_s": 3600, "hang_floor_s": 120, "hang": hang},
                      checkpoint={"save_steps": save_steps}, optim={"iterations": 40})
    _paced(sup, host, running(sup, host))
    host.mono += quiet_s
    assert sup.step() is next_state
    if next_state is State.CRASHED:
        assert sup.attempt.crash.cls is CrashClass.NCCL_TIMEOUT_HANG
        assert ("5 x the longest step gap" in sup.attempt.crash.evidence[0]) is (hang == "adaptive")
        events = [e for e in journal(sup).events() if e["kind"] == "hang_timer"]
        assert (len(events) == 2) is (hang == "adaptive"), events  # the bound first, then the adaptive timer


def test_adaptive_hang_timer_floor(world):
    """A fast attempt's timer never drops below hang_floor_s."""
    sup, host = world(supervisor={"hang_timeout_s": 3600, "hang_floor_s": 900}, checkpoint={"save_steps": 5},
                      optim={"iterations": 40})
    _paced(sup, host, running(sup, host))
    host.mono += 800
    assert sup.step() is State.RUNNING
    host.mono += 101
    assert sup.step() is State.CRASHED and "hang_floor_s = 900" in sup.attempt.crash.evidence[0]


# --- CRASHED: decide ------------------------------------------------------------------------------
PORT_TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 29500, useIPv6: False, code: -98, name: EADDRINUSE, message: address already in use")


@pytest.mark.parametrize("lines, code, action, wait_s", [
    ((OOM,), 1, Action.RELAUNCH, 90),
    (("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
      "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
      "ncclUnhandledCudaError: Call to CUDA function failed."), 1, Action.RELAUNCH, 120),
    (("OSError: [Errno 28] No space left on device",), 1, Action.WAIT_FOR_SPACE, 90),
    (("ValueError: unknown argument --foo",), 1, Action.GIVE_UP, 0),
    ((PORT_TAKEN,), 1, Action.RELAUNCH, 0),
])
def test_crashed_decides_by_class(world, lines, code, action, wait_s):
    sup, host = world()
    crashed(sup, host, *lines, code=code, at_step=0 if lines == (PORT_TAKEN,) else 5)
    host.calls.clear()
    assert sup.step() is State.CLEANING
    assert sup.attempt.decision.action is action and sup.attempt.decision.wait_s == wait_s
    assert not host.calls, "deciding is pure: no host call"


# --- CLEANING -------------------------------------------------------------------------------------
def test_cleaning_terminates_records_and_waits(world):
    sup, host = world()
    t = crashed(sup, host, OOM)
    sup.step()
    host.calls.clear()
    assert sup.step() is State.WAITING
    assert ("terminate", (t.pid,)) in host.calls
    row = journal(sup).last_attempt()
    assert row.ended_at is not None and row.cls is CrashClass.OOM_DURING_TRAINING and row.end_step == 5


def test_cleaning_after_give_up_ends_the_run(world):
    sup, host = world()
    crashed(sup, host, "ValueError: unknown argument --foo")
    sup.step()
    assert sup.step() is State.GAVE_UP and "class `other`" in sup.exit_reason


def test_cleaning_in_a_crash_loop_backs_off(world):
    sup, host = world(supervisor={"max_crashes_per_hour": 1})
    for _ in range(2):
        crashed(sup, host, OOM)
        sup.step()
        last = sup.step()
        if last is State.WAITING:
            drive(sup, State.RUNNING)
    assert last is State.BACKOFF and sup.attempt.decision.backoff_s > 0


# --- WAITING / BACKOFF ----------------------------------------------------------------------------
def test_a_fixed_wait_lasts_wait_s_of_the_clock_then_verifies(world):
    sup, host = world(supervisor={"wait": "fixed"})
    crashed(sup, host, OOM)
    sup.step(), sup.step()
    before = host.mono
    assert sup.step() is State.VERIFYING
    assert host.mono - before == pytest.approx(90)
    assert "shm_segments" not in host.names(), "fixed: the field's blind wait, nothing checked"


NCCL_LINES = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
              "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
              "ncclUnhandledCudaError: Call to CUDA function failed.")


def _clears_after(t_clear: float, what: str):
    """The world: `what` (leftover / gpu / shm / port) stays until the fake clock passes t_clear."""
    def world_moves(h: FakeHost, _s: float) -> None:
        if h.mono < t_clear:
            return
        h.leftover_pids, h.holders, h.taken_ports = [], {}, set()
        h.shm = {n: [] for n in h.shm}  # unmapped: an orphan the supervisor removes
    return world_moves


@pytest.mark.parametrize("what, lines, clears_at, waited", [
    ("nothing", (OOM,), None, 0.0),                       # all clear: the wait ends at once
    ("leftover", (OOM,), 7.0, 7.0),                       # a re-parented process of the run still alive
    ("gpu", (OOM,), 12.0, 12.0),                          # GPU memory not yet released
    ("shm", (OOM,), 3.0, 3.0),                            # an NCCL segment still mapped
    ("port", (OOM,), 5.0, 5.0),                           # no free rendezvous port
    ("leftover", (OOM,), 500.0, 90.0),                    # never clears: never longer than wait_s
    ("nothing", NCCL_LINES, None, 30.0),                  # nccl_*: the nccl_settle_s floor
    ("gpu", NCCL_LINES, 40.0, 40.0),                      # nccl_*: past the floor, until clear
])
def test_a_verified_wait_ends_when_the_run_is_gone(world, what, lines, clears_at, waited):
    sup, host = world(gpu={"check": True})
    crashed(sup, host, *lines)
    sup.step(), sup.step()
    if what == "leftover":
        host.leftover_pids = [777]
    elif what == "gpu":
        host.holders = {0: [888]}
    elif what == "shm":
        host.shm = {"nccl-AbC123": [999]}
    elif what == "port":
        host.taken_ports = set(range(29500, 29510))
    if clears_at is not None:
        host.on_wait = _clears_after(clears_at, what)
    before = host.mono
    assert sup.step() is State.VERIFYING
    assert host.mono - before == pytest.approx(waited, abs=0.26)  # polled every READY_POLL_S
    ev = [e for e in journal(sup).events(200) if e["kind"] == "wait"][-1]
    assert ev["data"]["mode"] == "verified" and ev["data"]["seconds"] == pytest.approx(waited, abs=0.26)
    assert bool(ev["data"]["not_clear"]) == (clears_at == 500.0), "the bound says what was still not clear"
    if what == "shm":
        assert ("remove_shm", ("nccl-AbC123",)) in host.calls and not host.shm
    spans = [k for _, _, k in journal(sup).spans()]
    assert "wait" in spans


def test_a_verified_wait_warms_the_page_cache_until_the_trainer_starts(world):
    sup, host = world()
    crashed(sup, host, OOM)
    sup.step(), sup.step()
    sup.step()
    assert host.warming is not None and ("warm_page_cache", 1) in host.calls
    drive(sup, State.RUNNING)
    assert host.warming is None and "stop_warming" in host.names()


def test_a_stop_cuts_a_verified_wait_short(world):
    sup, host = world()
    crashed(sup, host, OOM)
    sup.step(), sup.step()
    host.leftover_pids = [777]
    host.on_wait = lambda h, s: sup.request_stop("operator") if h.mono > 10 else None
    before = host.mono
    assert sup.step() is State.STOPPED
    assert host.mono - before < 11


def test_a_backoff_is_waited_in_full_before_the_readiness_checks(world):
    sup, host = world(supervisor={"max_crashes_per_hour": 1})
    for _ in range(2):
        crashed(sup, host, OOM)
        sup.step()
        if sup.step() is State.WAITING:
            drive(sup, State.RUNNING)
    backoff = sup.attempt.decision.backoff_s
    before = host.mono
    assert sup.step() is State.VERIFYING
    assert host.mono - before == pytest.approx(backoff, abs=0.01)


def test_waiting_for_disk_space(world):
    sup, host = world()
    crashed(sup, host, "OSError: [Errno 28] No space left on device")
    sup.step(), sup.step()
    host.free = 0.001
    assert sup.step() is State.WAITING and ("free_gib", sup.recipe.run.output_dir) in host.calls
    host.free = 10
    assert sup.step() is State.VERIFYING


def test_a_wait_for_disk_space_is_charged_to_wait_in_full(world):
    """Regression: a round that found too little space returned before its span was written, and goodput
    counted that time as `other`."""
    sup, host = world()
    crashed(sup, host, "OSError: [Errno 28] No space left on device")
    sup.step(), sup.step()
    host.free = 0.001
    began = host.now()
    assert sup.step() is State.WAITING and sup.step() is State.WAITING
    host.free = 10
    assert sup.step() is State.VERIFYING
    waited = sum(e - s for s, e, kind in journal(sup).spans() if kind == "wait" and s >= began)
    assert host.now() - began > 0 and waited == pytest.approx(host.now() - began, abs=0.01)


def test_a_stop_cuts_a_wait_short(world):
    sup, host = world(supervisor={"wait": "fixed"})
    crashed(sup, host, OOM)
    sup.step(), sup.step()
    host.on_wait = lambda h, s: sup.request_stop("operator") if h.mono > 30 else None
    assert sup.step() is State.STOPPED
    assert host.mono < 90


# --- RELAUNCHING ----------------------------------------------------------------------------------
def test_relaunch_after_port_in_use_takes_a_fresh_port(world):
    sup, host = world()
    crashed(sup, host, PORT_TAKEN, at_step=0)
    assert drive(sup, State.RELAUNCHING) is State.RELAUNCHING
    sup.step()
    assert [t.cmd.env["MASTER_PORT"] for t in host.trainers] == ["29500", "29501"]


def test_relaunch_keeps_the_port_when_it_is_free(world):
    sup, host = world()
    crashed(sup, host, OOM)
    drive(sup, State.RUNNING)
    assert [t.cmd.env["MASTER_PORT"] for t in host.trainers] == ["29500", "29500"]
    assert journal(sup).last_attempt().n == 2


# --- STOPPING -------------------------------------------------------------------------------------
def test_stopping_records_everything_the_trainer_wrote_on_the_way_out(world):
    """Issue 10: the recorded last step is the last step the trainer logged, also steps written after
    the SIGTERM (a JIT save finishing the step) that no pass had read yet."""
    sup, host = world()
    t = running(sup, host)
    t.steps(1, 3, MAX)
    sup.step()
    sup.request_stop("operator")
    assert sup.step() is State.STOPPING

    def terminate(run_id, pgids, grace_s, real=host.terminate):
        t.steps(4, 6, MAX)  # written between the SIGTERM and the exit
        return real(run_id, pgids, grace_s)
    host.terminate = terminate
    assert sup.step() is State.STOPPED
    row = journal(sup).last_attempt()
    assert row.end_step == 6 and row.cls is None and row.ended_at is not None
    assert journal(sup).get_all()["step"] == 6


# --- history across supervisors -------------------------------------------------------------------
def _nan_crash(sup, host):
    t = running(sup, host)
    t.steps(1, 3, MAX)
    t.write(str({"loss": "nan", "grad_norm": "nan", "global_step/max_steps": f"4/{MAX}"}))
    t.exit(code=1)
    assert sup.step() is State.CRASHED and sup.attempt.crash.cls is CrashClass.NAN_LOSS
    sup.step()


def test_nan_twice_gives_up_across_a_supervisor_restart(world):
    """Killed between two NaN crashes, the next supervisor still gives up on the second."""
    first, host = world()
    _nan_crash(first, host)
    assert first.attempt.decision.action is Action.RELAUNCH
    assert first.step() is State.WAITING
    first.ctx.lock.release()             # kill -9: no shutdown, the lock goes with the process
    first.ctx.journal.close()
    first.ctx = None
    second, host2 = world()
    _nan_crash(second, host2)
    assert second.attempt.decision.action is Action.GIVE_UP, second.attempt.decision
    assert second.step() is State.GAVE_UP


def test_crash_loop_count_survives_a_supervisor_restart(world):
    first, host = world(supervisor={"max_crashes_per_hour": 1})
    crashed(first, host, OOM)
    first.step(), first.step()
    first.ctx.lock.release()
    first.ctx.journal.close()
    first.ctx = None
    second, host2 = world(supervisor={"max_crashes_per_hour": 1})
    crashed(second, host2, OOM)
    second.step()
    assert second.attempt.decision.backoff_s > 0, "two crashes within the hour, across supervisors: back off"


def test_the_whole_loop_recovers_on_the_fake_clock(world):
    """One crash and a completion: the full path through run(), in fake time."""
    sup, host = world()

    def trainer_script(h, seconds):
        t = h.trainers[-1] if h.trainers else None
        if t is None or t.status is not None:
            return
        if len(h.trainers) == 1:
            t.steps(1, 5, MAX)
            t.write(OOM)
            t.exit(code=1)
        else:
            t.steps(1, MAX, MAX)
            t.exit(code=0)
    host.on_wait = trainer_script
    assert sup.run() == ExitCode.OK and sup.state is State.COMPLETED
    rows = journal(sup).attempts()
    assert [r.cls for r in rows] == [CrashClass.OOM_DURING_TRAINING, None]
    assert rows[1].end_step == MAX


def test_rebuild_history_table():
    from orchestrator.domain import policy
    from orchestrator.types import Attempt

    a = lambda n, cls, start, end, t: Attempt(n, t - 10, start_step=start, end_step=end, ended_at=t, cls=cls)  # noqa: E731
    h = policy.rebuild_history([a(1, CrashClass.NAN_LOSS, 0, 12, 100.0)], {10})
    assert h.previous_cls is CrashClass.NAN_LOSS and h.relaunches_without_progress == 0
    h = policy.rebuild_history([a(1, CrashClass.CUDA_FATAL, 10, 15, 100.0), a(2, CrashClass.CUDA_FATAL, 10, 14, 200.0)],
                               {10})
    assert h.relaunches_without_progress == 2 and len(h.crash_times) == 2
    h = policy.rebuild_history([a(1, None, 0, 5, 100.0)], set())
    assert h == policy.History(), "a stopped attempt is no crash"
    h = policy.rebuild_history([Attempt(1, 0.0, start_step=0)], set())
    assert h == policy.History(), "an attempt still open is no crash"
    d = policy.decide(Crash(CrashClass.NAN_LOSS), policy.rebuild_history([a(1, CrashClass.NAN_LOSS, 0, 12, 100.0)], {10}),
                      load_default_supervisor(), 150.0, False)
    assert d.action is Action.GIVE_UP


def load_default_supervisor():
    from orchestrator.config.recipe import SupervisorSection
    return SupervisorSection()


# --- save_steps = "auto" and the measured costs (interval.py, costs.py) -----------------------------
def _argv_save_steps(t) -> int:
    argv = list(t.cmd.argv)
    return int(argv[argv.index("--save_steps") + 1])


def test_auto_save_interval_is_chosen_at_every_launch_from_the_evidence(world, monkeypatch):
    from orchestrator.domain import interval
    sup, host = world(checkpoint={"save_steps": "auto"}, supervisor={"max_relaunches_without_progress": 100})
    drive(sup, State.LAUNCHING)  # the tiny model's save written at a speed that makes it take 100 s
    monkeypatch.setattr(interval, "DEFAULT_WRITE_BYTES_PER_S", sup.ctx.save_gib * 2**30 / 100)
    t = running(sup, host)
    first = interval.starting_choice(sup.ctx.save_gib * 2**30, *sup.ctx.intervals.step_time)
    assert _argv_save_steps(t) == first.steps
    ev = [e for e in journal(sup).events(200) if e["kind"] == "save_interval"]
    assert len(ev) == 1 and ev[0]["data"]["steps"] == first.steps and "prior" in ev[0]["data"]["save_source"]
    for _ in range(3):  # crashes shorten the mean time between failures: the interval shrinks
        t.steps(1, 2, MAX)
        t.exit(signal=9)
        assert sup.step() is State.CRASHED
        drive(sup, State.RUNNING)
        t = host.trainers[-1]
    ev = [e for e in journal(sup).events(400) if e["kind"] == "save_interval"]
    assert len(ev) == 4 and ev[-1]["data"]["failures"] == 3
    assert _argv_save_steps(t) == ev[-1]["data"]["steps"] < first.steps


def test_a_fixed_save_interval_is_rendered_as_given(world):
    sup, host = world(checkpoint={"save_steps": 7})
    assert _argv_save_steps(running(sup, host)) == 7
    assert not [e for e in journal(sup).events(200) if e["kind"] == "save_interval"]


def test_startup_and_save_seconds_are_measured_and_journalled(world):
    sup, host = world(checkpoint={"save_steps": 4})
    t = running(sup, host)
    launched_at = journal(sup).last_attempt().started_at
    host.mono += 20.0           # the model load
    t.steps(1, 2, MAX)
    sup.step()                  # first step seen: startup = 20 s + the 0.5 s poll
    host.mono += 0.5
    t.steps(3, 4, MAX)
    sup.step()                  # 2 steps per 1 s pass: 0.5 s per step
    t.write("[INFO:swift] Saving model checkpoint to /o/checkpoint-4")
    host.mono += 29.5           # the save
    sup.step()
    t.steps(5, 6, MAX)
    sup.step()                  # step 6 seen 30.5 s after step 4: 30.5 - 2 x 0.5 = 29.5 s of saving
    row = sup.attempt.row
    assert row.startup_s == pytest.approx(20.5) and row.save_s == pytest.approx(29.5) and row.save_count == 1
    t.exit(signal=9)
    drive(sup, State.WAITING)   # CLEANING records the row, with its costs
    rec = journal(sup).last_attempt()
    assert rec.started_at == launched_at and (rec.startup_s, rec.save_s, rec.save_count) == (20.5, 29.5, 1)
    kinds = [e["kind"] for e in journal(sup).events(200)]
    assert "startup_seconds" in kinds and "save_seconds" in kinds
    assert sup.metrics.exposition().count(b"orchestrator_checkpoint_save_seconds 29.5") == 1
    assert b"orchestrator_startup_seconds 20.5" in sup.metrics.exposition()
    assert b"orchestrator_save_interval_steps 4.0" in sup.metrics.exposition()
