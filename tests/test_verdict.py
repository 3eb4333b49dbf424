"""verdict.py's combination rules as a table: (log, exit status, phase, system evidence) -> class and the
system fact the evidence leads with."""
from __future__ import annotations

import time

import pytest

from orchestrator.types import (Crash, CrashClass as C, DiskSpace, ExitStatus, GpuFault, OomKill, Phase, PortOwner,
                                SystemEvidence)
from orchestrator.domain.verdict import NO_OOM_RECORD, classify_attempt, combine

GIB = 1024**3
AT = time.mktime((2024, 5, 1, 12, 3, 5, 0, 0, -1))
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"
NCCL = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"
TIMEOUT = "[rank1]:[E ProcessGroupNCCL.cpp:563] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."
TORCHRUN_KILL = "torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 0 (pid: 1234) of binary: python"
PORT = "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
ENOSPC = "OSError: [Errno 28] No space left on device"
STEP = "{'loss': '1.25', 'grad_norm': '0.5', 'learning_rate': '1e-4', 'global_step/max_steps': '3/10'}"
VALUE = "ValueError: bad value"

KMSG = SystemEvidence(kernel_log="/dev/kmsg")
OOM_KILL = SystemEvidence(oom_kills=(OomKill(1234, "python", AT, "Out of memory: Killed process 1234 (python)"),),
                          kernel_log="/dev/kmsg")
CGROUP_ONLY = SystemEvidence(cgroup_oom_kills=("memory cgroup /sys/fs/cgroup/x: oom_kill 0 -> 1",),
                             unavailable=("kernel log: not available: /dev/kmsg: Permission denied",))
NO_KERNEL = SystemEvidence(unavailable=("kernel log: not available: /dev/kmsg: Permission denied",))
FULL = SystemEvidence(disks=(DiskSpace("output_dir", "/out", 10 << 20, 100 * GIB, 5000),), kernel_log="/dev/kmsg")
NO_INODES = SystemEvidence(disks=(DiskSpace("output_dir", "/out", 50 * GIB, 100 * GIB, 0),), kernel_log="/dev/kmsg")
ROOMY = SystemEvidence(disks=(DiskSpace("output_dir", "/out", 50 * GIB, 100 * GIB, 5000),
                              DiskSpace("persistent_dir", "/p", 0, 100 * GIB, 5000)), kernel_log="/dev/kmsg")
SHM_FULL = SystemEvidence(disks=(DiskSpace("/dev/shm", "/dev/shm", 1 << 20, 64 * GIB, 10**6),), kernel_log="/dev/kmsg")
XID79 = SystemEvidence(gpu_faults=(GpuFault(3, "xid", "Xid 79", 79),), kernel_log="/dev/kmsg")
XID45 = SystemEvidence(gpu_faults=(GpuFault(3, "xid", "Xid 45", 45),), kernel_log="/dev/kmsg")
ECC = SystemEvidence(gpu_faults=(GpuFault(1, "ecc", "uncorrected ECC errors 0 -> 2"),), kernel_log="/dev/kmsg")
OWNER = SystemEvidence(port_owners=(PortOwner(29500, 77, "python3 -m http.server 29500"),), kernel_log="/dev/kmsg")
SIGKILL, EXIT1 = ExitStatus(signal=9), ExitStatus(code=1)


@pytest.mark.parametrize("log, exit, phase, system, cls, first", [
    # a kernel OOM kill of a run process is the root of the cascade it causes
    ("", SIGKILL, None, OOM_KILL, C.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed pid 1234 (python) at 12:03:05"),
    (NCCL, EXIT1, None, OOM_KILL, C.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed pid 1234"),
    (TIMEOUT, EXIT1, None, OOM_KILL, C.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed pid 1234"),
    (VALUE, EXIT1, None, OOM_KILL, C.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed pid 1234"),
    ("", SIGKILL, None, CGROUP_ONLY, C.HOST_OOM_KILLED, "SIGKILL; kernel OOM killer killed a process of the run's memory cgroup"),
    # ... but not of a GPU OOM, which stays what the log says (the kill is reported beside it)
    (OOM, EXIT1, Phase.TRAINING, OOM_KILL, C.OOM_DURING_TRAINING, "SIGKILL; kernel OOM killer killed pid 1234"),
    # a SIGKILL the kernel did not record as an OOM kill says so (the class stays: "SIGKILL and no other cause")
    ("", SIGKILL, None, KMSG, C.HOST_OOM_KILLED, NO_OOM_RECORD),
    (TORCHRUN_KILL, EXIT1, None, KMSG, C.HOST_OOM_KILLED, NO_OOM_RECORD),
    ("", SIGKILL, None, NO_KERNEL, C.HOST_OOM_KILLED,
     "SIGKILL; kernel OOM records not available: /dev/kmsg: Permission denied"),
    # a disk full at the crash outranks whatever the log shows
    (NCCL, EXIT1, None, FULL, C.DISK_FULL, "disk full at the crash: /out has 0.00977 GiB free"),
    (OOM, EXIT1, Phase.TRAINING, FULL, C.DISK_FULL, "disk full at the crash"),
    ("", SIGKILL, None, FULL, C.DISK_FULL, "disk full at the crash"),
    (ENOSPC, EXIT1, None, FULL, C.DISK_FULL, "disk full at the crash"),
    (NCCL, EXIT1, None, NO_INODES, C.DISK_FULL, "disk full at the crash: /out has no free inodes"),
    # a full persistent_dir is not what failed the trainer's writes; a nearly full /dev/shm is told
    (NCCL, EXIT1, None, ROOMY, C.NCCL_ERROR, NCCL[:40]),
    (NCCL, EXIT1, None, SHM_FULL, C.NCCL_ERROR, "/dev/shm nearly full at the crash: 1 MiB free"),
    # a hardware fault on a run GPU outranks the cascade, not a GPU OOM; application Xids do not count
    (NCCL, EXIT1, None, XID79, C.CUDA_FATAL, "GPU 3: Xid 79 since launch"),
    (TIMEOUT, EXIT1, None, ECC, C.CUDA_FATAL, "GPU 1: uncorrected ECC errors 0 -> 2 since launch"),
    (OOM, EXIT1, Phase.STARTUP, XID79, C.COLD_START_OOM, "GPU 3: Xid 79 since launch"),
    (NCCL, EXIT1, None, XID45, C.NCCL_ERROR, NCCL[:40]),
    # the port's owner is named next to the log's line
    (PORT, EXIT1, None, OWNER, C.PORT_IN_USE, "port 29500 held by pid 77 (python3 -m http.server 29500)"),
    # phase from the progress the supervisor saw decides cold start vs during training
    (OOM, EXIT1, Phase.STARTUP, KMSG, C.COLD_START_OOM, OOM[:40]),
    (OOM, EXIT1, Phase.TRAINING, KMSG, C.OOM_DURING_TRAINING, OOM[:40]),
    (f"{STEP}\n{OOM}", EXIT1, None, KMSG, C.OOM_DURING_TRAINING, OOM[:40]),
    (f"{STEP}\n{OOM}", EXIT1, Phase.STARTUP, KMSG, C.COLD_START_OOM, OOM[:40]),
    # nothing from the machine: the log's verdict as it was
    (VALUE, EXIT1, None, SystemEvidence(), C.OTHER, VALUE),
])
def test_combination(log, exit, phase, system, cls, first):
    crash = classify_attempt(log, exit, phase, system, need_free_gib=0.5)
    assert crash.cls is cls, crash
    assert crash.evidence[0].startswith(first), crash.evidence


def test_a_kill_without_kernel_record_never_says_oom_in_its_evidence():
    crash = classify_attempt("", SIGKILL, None, KMSG, 0.5)
    assert crash.evidence[0] == "SIGKILL; no kernel OOM record for the run's processes"
    assert not any("out of memory" in e.lower() or "oom killer" in e.lower() for e in crash.evidence)


def test_the_log_class_is_named_when_the_disk_outranks_it():
    crash = combine(Crash(C.NCCL_ERROR, (NCCL,), Phase.TRAINING), EXIT1, FULL, 0.5)
    assert crash.evidence[:2] == ("disk full at the crash: /out has 0.00977 GiB free", "(the log alone said nccl_error)")
    assert crash.evidence[-1] == NCCL and crash.phase is Phase.TRAINING


def test_no_system_fact_leaves_the_crash_as_it_was():
    log = Crash(C.NCCL_TIMEOUT_HANG, ("no step for 600 s",), Phase.TRAINING)
    assert combine(log, None, ROOMY, 0.5) is log


@pytest.mark.parametrize("args, cls, phase", [
    ([], "cold_start_oom", "unknown"),                       # no step in the log: a start-up OOM
    (["--phase", "training"], "oom_during_training", "training"),
    (["--phase", "startup"], "cold_start_oom", "startup"),
])
def test_classify_command_takes_the_phase(tmp_path, args, cls, phase):
    import json

    from click.testing import CliRunner

    from orchestrator.ops.cli import main

    log = tmp_path / "crash.log"
    log.write_text(OOM + "\n")
    res = CliRunner().invoke(main, ["classify", str(log), "--json", *args])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) | {"evidence": None} == {"class": cls, "phase": phase, "evidence": None}


def test_classify_command_refuses_an_unknown_phase(tmp_path):
    from click.testing import CliRunner

    from orchestrator.ops.cli import main

    (log := tmp_path / "crash.log").write_text(OOM)
    res = CliRunner().invoke(main, ["classify", str(log), "--phase", "warmup"])
    assert res.exit_code == 2 and "--phase" in res.output


@pytest.mark.parametrize("cls", list(C))
def test_every_class_runbook_shows_the_system_evidence(cls):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "runbooks" / f"{cls.value}.md").read_text()
    section = page.split("## System evidence orchestrator records", 1)[1].split("\n## ", 1)[0]
    assert "By hand:" in section and "README.md#system-evidence-what-the-machine-said-at-the-crash" in section
