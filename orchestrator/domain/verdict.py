"""The verdict on a failed attempt: the log's class (classify.py) combined with what the machine said
(SystemEvidence, read by evidence.py). Pure.

The machine outranks the log where it knows better: a disk full at the crash and a hardware fault on a
run GPU outrank any cascade the log shows (the trainer's last line may be what it could not write, or
the NCCL abort a dead GPU caused); a kernel OOM kill of a run process is the root of the SIGKILLs,
vanished peers and timeouts it causes. A SIGKILL the kernel did not record as an OOM kill says so. The
class names stay the eleven of CrashClass; the evidence names the system facts that decided.
"""
from __future__ import annotations

import time

from orchestrator.domain.classify import classify
from orchestrator.types import Crash, CrashClass, ExitStatus, Phase, SystemEvidence

GIB = 1024**3
MIB = 1024**2
SHM_LOW_BYTES = 64 * MIB     # /dev/shm this empty breaks NCCL's shm transport and DataLoader workers
# Xids that an application causes (an illegal access: 13, 31, 43) or that a killed process leaves
# behind (45, "preemptive cleanup"): they follow the crash, they do not cause it.
APP_XIDS = frozenset({13, 31, 43, 45})
# What a failure of the machine is the root of: the log's cascades and the supervisor's hang verdict.
CASCADE = frozenset({CrashClass.NCCL_ERROR, CrashClass.NCCL_TIMEOUT_HANG, CrashClass.HOST_OOM_KILLED, CrashClass.OTHER})
NO_OOM_RECORD = "SIGKILL; no kernel OOM record for the run's processes"
DISK_FULL_AT_CRASH = "disk full at the crash"   # the fact's head: policy tells output_dir's disk_full by it


def classify_attempt(text: str, exit: ExitStatus | None, phase: Phase | None, system: SystemEvidence,
                     need_free_gib: float) -> Crash:
    """(log, exit status, phase from the progress seen, system evidence) -> Crash."""
    return combine(classify(text, exit, phase), exit, system, need_free_gib)


def combine(log: Crash, exit: ExitStatus | None, system: SystemEvidence, need_free_gib: float) -> Crash:
    """The log's verdict, corrected by the system evidence. `need_free_gib`: output_dir with less free than
    this at the crash was full (the supervisor passes min(min_free_gib, 1 GiB))."""
    cls, facts = log.cls, []
    if full := disk_full(system, need_free_gib):
        facts.append(full)
        if cls is not CrashClass.DISK_FULL:
            facts.append(f"(the log alone said {cls.value})")
            cls = CrashClass.DISK_FULL
    if gpu := gpu_faults(system):
        facts += gpu
        if cls in CASCADE or cls is CrashClass.CUDA_FATAL:
            cls = CrashClass.CUDA_FATAL
    kills = oom_kills(system)
    if kills:
        facts += kills
        if cls in CASCADE:
            cls = CrashClass.HOST_OOM_KILLED
    elif cls is CrashClass.HOST_OOM_KILLED or (exit is not None and exit.killed_by == 9):
        facts.append(NO_OOM_RECORD if system.kernel_log else
                     "SIGKILL; kernel OOM records not available: " + _why_kernel(system))
    facts += port_facts(system, log) + shm_facts(system)
    if not facts:
        return log
    return Crash(cls, tuple(f[:500] for f in facts) + log.evidence, log.phase)


def disk_full(system: SystemEvidence, need_free_gib: float) -> str | None:
    """output_dir's disk full at the crash: less free than need_free_gib, or no free inode."""
    for d in system.disks:
        if d.role != "output_dir":
            continue
        if d.free_bytes < need_free_gib * GIB:
            return f"{DISK_FULL_AT_CRASH}: {d.path} has {d.free_bytes / GIB:.3g} GiB free"
        if d.free_inodes == 0:
            return f"{DISK_FULL_AT_CRASH}: {d.path} has no free inodes ({d.free_bytes / GIB:.3g} GiB free)"
    return None


def gpu_faults(system: SystemEvidence) -> list[str]:
    """Hardware faults on run GPUs since launch (ECC increases, Xids other than the application's)."""
    return [f"GPU {f.gpu}: {f.detail} since launch" for f in system.gpu_faults
            if f.kind == "ecc" or (f.xid is not None and f.xid not in APP_XIDS)]


def oom_kills(system: SystemEvidence) -> list[str]:
    """The kernel's OOM kills of run processes, else a rise of the run's memory cgroup oom_kill counter."""
    lines = [f"SIGKILL; kernel OOM killer killed pid {k.pid} ({k.comm}) at {time.strftime('%H:%M:%S', time.localtime(k.at))}"
             for k in system.oom_kills]
    if system.cgroup_oom_kills:
        if not lines:
            lines.append("SIGKILL; kernel OOM killer killed a process of the run's memory cgroup")
        lines += list(system.cgroup_oom_kills)
    return lines


def port_facts(system: SystemEvidence, log: Crash) -> list[str]:
    if log.cls is not CrashClass.PORT_IN_USE:
        return []
    return [f"port {o.port} held by pid {o.pid} ({o.cmdline or '?'})" if o.pid is not None
            else f"port {o.port} held by a process this user cannot see (run `ss -ltnp 'sport = :{o.port}'` as root)"
            for o in system.port_owners]


def shm_facts(system: SystemEvidence) -> list[str]:
    return [f"{d.path} nearly full at the crash: {d.free_bytes / MIB:.0f} MiB free" for d in system.disks
            if d.role == "/dev/shm" and d.free_bytes < SHM_LOW_BYTES]


def _why_kernel(system: SystemEvidence) -> str:
    return next((u.split(": not available: ", 1)[-1] for u in system.unavailable if u.startswith("kernel log")), "not read")
