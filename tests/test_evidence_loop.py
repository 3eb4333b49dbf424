"""The loop with system evidence, table-tested on the in-memory host: the baseline at launch, the
evidence at the crash (scripted), the class it decides, the console line, the journal's attempts.system."""
from __future__ import annotations

import json
import time

import pytest

from fake_host import GIB
from orchestrator.types import CrashClass, DiskSpace, GpuFault, OomKill, PortOwner, State, SystemEvidence
from orchestrator.domain.verdict import NO_OOM_RECORD
from loop_world import MAX, OOM, crashed, drive, journal, running

NCCL = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"
PORT = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
AT = time.mktime((2024, 5, 1, 12, 3, 5, 0, 0, -1))
KILLED = SystemEvidence(oom_kills=(OomKill(4000, "python", AT, "Out of memory: Killed process 4000 (python)"),),
                        kernel_log="/dev/kmsg")
XID = SystemEvidence(gpu_faults=(GpuFault(0, "xid", "Xid 79", 79),), kernel_log="/dev/kmsg")
OWNER = SystemEvidence(port_owners=(PortOwner(29500, 77, "python3 -m http.server 29500"),), kernel_log="/dev/kmsg")


def test_the_baseline_is_taken_at_each_launch(world):
    sup, host = world()
    t = running(sup, host)
    assert ("evidence_baseline", t.pid) in host.calls
    assert host.names().index("evidence_baseline") > host.names().index("launch")


@pytest.mark.parametrize("lines, code, signal, system, free, cls, first", [
    # the log says NCCL, the kernel says it killed the trainer: the kill is the root
    ((NCCL,), 1, None, KILLED, 1000, CrashClass.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed pid 4000 (python) at 12:03:05"),
    # a SIGKILL the kernel did not record (the demo's injected kill) says so
    ((), None, 9, None, 1000, CrashClass.HOST_OOM_KILLED, NO_OOM_RECORD),
    # a disk full at the crash outranks the log (the rule _disk_full had, now in verdict.combine)
    ((NCCL,), 1, None, None, 0.001, CrashClass.DISK_FULL, "disk full at the crash"),
    ((OOM,), 1, None, None, 0.001, CrashClass.DISK_FULL, "disk full at the crash"),
    # an Xid on a run GPU outranks the NCCL cascade
    ((NCCL,), 1, None, XID, 1000, CrashClass.CUDA_FATAL, "GPU 0: Xid 79 since launch"),
    # the port's owner, asked only when the log says the address is in use
    ((PORT,), 1, None, OWNER, 1000, CrashClass.PORT_IN_USE, "port 29500 held by pid 77"),
    # nothing from the machine: the log's class (phase from progress: steps were seen)
    ((OOM,), 1, None, None, 1000, CrashClass.OOM_DURING_TRAINING, "torch.OutOfMemoryError"),
], ids=["kernel_oom", "sigkill_no_record", "disk_full_nccl", "disk_full_oom", "xid", "port_owner", "log_only"])
def test_the_crash_is_decided_with_the_system_evidence(world, lines, code, signal, system, free, cls, first):
    sup, host = world()
    host.system, host.free = system, free
    t = running(sup, host)
    if cls is not CrashClass.PORT_IN_USE:   # a taken port stops the start-up, before any step
        t.steps(1, 5, MAX)
    t.write(*lines)
    t.exit(code=code, signal=signal)
    assert sup.step() is State.CRASHED
    assert sup.attempt.crash.cls is cls, sup.attempt.crash
    assert sup.attempt.crash.evidence[0].startswith(first), sup.attempt.crash.evidence
    asked = [c for c in host.calls if c[0] == "evidence"]
    assert asked == [("evidence", t.pid, 29500 if cls is CrashClass.PORT_IN_USE else None)]


def test_the_evidence_is_told_on_the_console_and_kept_per_attempt(world):
    sup, host = world()
    said = []
    sup.step()   # pre-flight opens the journal, whose events are the console lines
    sup.ctx.journal.echo = said.append
    host.system = KILLED
    crashed(sup, host, NCCL)
    assert any("evidence: attempt 1: SIGKILL; kernel OOM killer killed pid 4000 (python)" in s for s in said), said
    drive(sup, State.WAITING)
    row = journal(sup).attempts()[0]
    assert row.cls is CrashClass.HOST_OOM_KILLED and row.evidence[0].startswith("SIGKILL; kernel OOM killer killed")
    assert row.system["oom_kills"][0]["pid"] == 4000 and row.system["kernel_log"] == "/dev/kmsg"
    assert json.loads(json.dumps(row.system)) == row.system


def test_a_sigkill_without_record_never_says_oom_on_the_console(world):
    sup, host = world()
    said = []
    sup.step()   # pre-flight opens the journal, whose events are the console lines
    sup.ctx.journal.echo = said.append
    t = running(sup, host)
    t.exit(signal=9)
    sup.step()
    told = [s for s in said if " evidence: " in s]
    assert told and told[0].endswith(f"attempt 1: {NO_OOM_RECORD}")
    assert not any("oom killer" in s.lower() or "out of memory" in s.lower() for s in said)


def test_the_evidence_of_a_hang_is_taken_while_the_trainer_runs(world):
    sup, host = world()
    host.system = SystemEvidence(disks=(DiskSpace("output_dir", "/o", 50 * GIB, 100 * GIB, 10),), kernel_log="k")
    t = running(sup, host)
    t.steps(1, 2, MAX)
    sup.step()
    host.mono += 601
    assert sup.step() is State.CRASHED and sup.attempt.crash.cls is CrashClass.NCCL_TIMEOUT_HANG
    assert ("evidence", t.pid, None) in host.calls


BUS = ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's "
       "workers are out of shared memory. Please try to raise your shared memory limit.")


def shm_disks(total_gib: float, free_gib: float) -> SystemEvidence:
    return SystemEvidence(disks=(DiskSpace("output_dir", "/o", 500 * GIB, 1000 * GIB, 10**6),
                                 DiskSpace("/dev/shm", "/dev/shm", int(free_gib * GIB), int(total_gib * GIB), 10**6)),
                          kernel_log="k")


def test_a_container_s_small_dev_shm_gives_up_with_the_fix(world):
    """Docker's 64 MiB /dev/shm: no wait frees enough, every relaunch would die the same way."""
    sup, host = world()
    host.system = shm_disks(total_gib=0.0625, free_gib=0.0)
    crashed(sup, host, BUS)
    assert sup.attempt.crash.cls is CrashClass.DISK_FULL
    assert drive(sup, State.GAVE_UP) is State.GAVE_UP
    crash = next(e for e in journal(sup).events() if e["kind"] == "crash")
    assert "/dev/shm exhausted and only 64 MiB in all" in crash["message"] and "--shm-size" in crash["message"], crash
    assert not [c for c in host.calls if c[0] == "launch"][1:], "nothing relaunched"


def test_a_full_dev_shm_waits_for_shared_memory_not_for_the_output_disk(world):
    """A 16 GiB /dev/shm that is full: the run's unmapped NCCL segments go, the wait is for /dev/shm's space."""
    sup, host = world()
    host.system = shm_disks(total_gib=16, free_gib=0.01)
    host.free_at["/dev/shm"] = 0.01
    host.shm = {"nccl-shm-run-1": []}   # left by the dead rank, mapped by nobody
    crashed(sup, host, BUS)
    since_crash = len(host.calls)
    assert drive(sup, State.WAITING) is State.WAITING
    assert sup.step() is State.WAITING
    assert ("remove_shm", ("nccl-shm-run-1",)) in host.calls
    waiting = [e for e in journal(sup).events() if e["kind"] == "disk_full"]
    assert waiting and waiting[-1]["message"].startswith("/dev/shm: 0.0 GiB free, waiting for 1"), waiting
    assert {c[1] for c in host.calls[since_crash:] if c[0] == "free_gib"} == {"/dev/shm"}
    host.free_at["/dev/shm"] = 12.0   # whatever held it is gone
    assert drive(sup, State.RUNNING) is State.RUNNING
    assert len([c for c in host.calls if c[0] == "launch"]) == 2
