"""The evidence readers against the real thing where it runs here: a kernel OOM kill in a small memory
cgroup, a plain kill -9, a listener on the rendezvous port, full filesystems (tmpfs); NVML and the
kernel journal through stand-ins."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from orchestrator.host import evidence, gpu
from orchestrator.host.evidence import AttemptEvidence, KernelLine, kernel_lines, oom_kills, parse_kmsg_record
from orchestrator.host.base import LocalHost
from orchestrator.types import Command, CrashClass, Phase
from orchestrator.domain.verdict import NO_OOM_RECORD, classify_attempt
from disk import fill

V1_MEMORY = Path("/sys/fs/cgroup/memory")
# A trainer stand-in: waits on a FIFO (the test's go), then touches `MiB` MiB of memory page by page.
HOG = ("import sys; open(sys.argv[1]).read(); n = int(sys.argv[2]) << 20; b = bytearray(n)\n"
       "for i in range(0, n, 4096): b[i] = 1\nprint('survived')")


# ---- kernel OOM kill in a memory cgroup (real) ------------------------------------------------------
@pytest.fixture
def small_cgroup():
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    try:
        evidence.read_kmsg()
    except OSError as e:
        pytest.skip(f"/dev/kmsg is not readable here: {e}")
    if (V1_MEMORY / "memory.limit_in_bytes").exists():
        cg, limit = V1_MEMORY / f"orch-test-{uuid.uuid4().hex[:8]}", "memory.limit_in_bytes"
    elif Path("/sys/fs/cgroup/cgroup.controllers").exists() and "memory" in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text():
        cg, limit = Path("/sys/fs/cgroup") / f"orch-test-{uuid.uuid4().hex[:8]}", "memory.max"
    else:
        pytest.skip("no cgroup memory controller (v1 memory or v2 memory.max) here")
    try:
        cg.mkdir()
        (cg / limit).write_text(str(64 << 20))
        if (cg / "memory.swappiness").exists():
            (cg / "memory.swappiness").write_text("0")   # v1: hitting the limit must kill, not swap
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup: {e}")
    yield cg
    cg.rmdir()   # the children are dead and reaped by then


def confined_trainer(tmp_path: Path, cg: Path, mib: int):
    """A real launch (LocalHost) of HOG, moved into cgroup `cg` before it allocates; returns (host, trainer, go)."""
    host = LocalHost(gpu.NullReader())
    go = tmp_path / "go"
    os.mkfifo(go)
    t = host.launch(Command((sys.executable, "-c", HOG, str(go), str(mib))), tmp_path / "trainer.log", "run-x",
                    cwd=str(tmp_path))
    (cg / "cgroup.procs").write_text(str(t.pid))
    host.evidence_baseline(t, "run-x", [])
    return host, t, go


def release(go: Path) -> None:
    with open(go, "w") as f:   # the trainer's open() of the FIFO returns once this end opens
        f.write("go")


def test_a_kernel_oom_kill_in_a_small_cgroup_is_host_oom_killed_with_the_kernel_record(tmp_path, small_cgroup):
    host, t, go = confined_trainer(tmp_path, small_cgroup, 256)
    release(go)
    assert host.wait_exit(t, 60) and t.status.killed_by == 9, t.status
    system = host.evidence(t, {"output_dir": str(tmp_path)}, None)
    assert [k.pid for k in system.oom_kills] == [t.pid], system
    assert "Killed process" in system.oom_kills[0].line and system.kernel_log == "/dev/kmsg"
    assert any(f"{small_cgroup}: oom_kill 0 -> 1" in c for c in system.cgroup_oom_kills), system.cgroup_oom_kills
    crash = classify_attempt(host.read_tail(t.log_path), t.status, Phase.STARTUP, system, 0.001)
    assert crash.cls is CrashClass.HOST_OOM_KILLED
    assert crash.evidence[0].startswith(f"SIGKILL; kernel OOM killer killed pid {t.pid} ("), crash.evidence


def test_a_plain_kill_9_of_the_same_child_is_no_oom(tmp_path, small_cgroup):
    host, t, go = confined_trainer(tmp_path, small_cgroup, 16)   # fits: only the kill ends it
    os.kill(t.pid, 9)
    assert host.wait_exit(t, 60) and t.status.killed_by == 9
    system = host.evidence(t, {"output_dir": str(tmp_path)}, None)
    assert system.oom_kills == () and system.cgroup_oom_kills == () and system.kernel_log == "/dev/kmsg"
    crash = classify_attempt(host.read_tail(t.log_path), t.status, Phase.STARTUP, system, 0.001)
    assert crash.cls is CrashClass.HOST_OOM_KILLED   # the README's "SIGKILL and no other cause"
    assert crash.evidence[0] == NO_OOM_RECORD
    assert not any("oom killer" in e.lower() or "out of memory" in e.lower() for e in crash.evidence)


# ---- the rendezvous port's owner (real) -------------------------------------------------------------
PORT_LOG = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
            "port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def test_a_listener_on_the_rendezvous_port_is_found_by_pid(tmp_path):
    listener = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0));"
                                 " s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        host = LocalHost(gpu.NullReader())
        t = host.launch(Command((sys.executable, "-c", f"print({PORT_LOG.format(port=port)!r}); raise SystemExit(1)")),
                        tmp_path / "trainer.log", "run-p", cwd=str(tmp_path))
        host.evidence_baseline(t, "run-p", [])
        assert host.wait_exit(t, 60)
        system = host.evidence(t, {"output_dir": str(tmp_path)}, port)
        assert [o.pid for o in system.port_owners] == [listener.pid], system
        assert "socket" in system.port_owners[0].cmdline
        crash = classify_attempt(host.read_tail(t.log_path), t.status, None, system, 0.001)
        assert crash.cls is CrashClass.PORT_IN_USE
        assert crash.evidence[0].startswith(f"port {port} held by pid {listener.pid} ("), crash.evidence
    finally:
        listener.kill()
        listener.wait()


# ---- full filesystems (real tmpfs) ---------------------------------------------------------------
NCCL = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"


def test_a_full_filesystem_at_the_crash_outranks_the_log(small_disk):
    out = small_disk / "out"
    out.mkdir()
    fill(small_disk / "filler.bin")
    system, why = evidence.disk_space({"output_dir": str(out), "/dev/shm": "/dev/shm", "persistent_dir": "h:/x"})
    assert [d.role for d in system] == ["output_dir", "/dev/shm"] and system[0].free_bytes < 1 << 20
    assert why == ["disk persistent_dir: not available: h:/x is on another host"]
    crash = classify_attempt(NCCL, None, Phase.TRAINING, evidence_of(system), 0.004)
    assert crash.cls is CrashClass.DISK_FULL and crash.evidence[0].startswith(f"disk full at the crash: {out} has 0")


def test_no_free_inode_is_a_full_disk(mount_tmpfs):
    mnt = mount_tmpfs("size=8m,nr_inodes=64", "inodes")
    with pytest.raises(OSError):
        for i in range(1000):
            (mnt / f"f{i}").touch()
    system, _ = evidence.disk_space({"output_dir": str(mnt)})
    assert system[0].free_inodes == 0 and system[0].free_bytes > 4 << 20
    crash = classify_attempt(NCCL, None, Phase.TRAINING, evidence_of(system), 0.001)
    assert crash.cls is CrashClass.DISK_FULL and "no free inodes" in crash.evidence[0]


def evidence_of(disks):
    from orchestrator.types import SystemEvidence
    return SystemEvidence(disks=tuple(disks), kernel_log="/dev/kmsg")


# ---- NVML through a stand-in ---------------------------------------------------------------------
class FakeNVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeEvent:
    def __init__(self, device, xid):
        self.device, self.eventData = device, xid


class FakeNvml:
    """pynvml's calls the readers make: 4 GPUs, volatile uncorrected ECC counters, a queue of Xid events."""

    NVML_ERROR_TIMEOUT = 10
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, fail_init: bool = False):
        self.fail_init, self.ecc = fail_init, {i: 0 for i in range(4)}
        self.events: queue.Queue = queue.Queue()
        self.registered: list[int] = []
        self.shut = False

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError(9)   # NVML_ERROR_DRIVER_NOT_LOADED

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", i)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h[1]}{h[1]}{h[1]}-uuid".encode()

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self.ecc[h[1]]

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, types, evset):
        self.registered.append(h[1])

    def nvmlEventSetWait(self, evset, timeout_ms):
        try:
            i, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT) from None
        return FakeEvent(("h", i), xid)

    def nvmlEventSetFree(self, evset):
        pass


def test_xid_events_and_ecc_increases_on_the_run_gpus_only():
    nv = FakeNvml()
    watch = AttemptEvidence(os.getpid(), "run-n", 0.0, lambda: True, nv=nv, gpus=[0, "GPU-222"], sample_s=0.05,
                            kernel=lambda: ([], "/dev/kmsg", None))
    assert nv.registered == [0, 2]
    nv.events.put((2, 79))
    nv.ecc[0], nv.ecc[1] = 2, 5   # GPU 1 is not the run's
    system = watch.collect({}, None)
    assert {(f.gpu, f.kind, f.detail) for f in system.gpu_faults} == {(2, "xid", "Xid 79"),
                                                                       (0, "ecc", "uncorrected ECC errors 0 -> 2")}
    assert nv.shut and not any(u.startswith("NVML") for u in system.unavailable)
    crash = classify_attempt(NCCL, None, Phase.TRAINING, system, 0.001)
    assert crash.cls is CrashClass.CUDA_FATAL and crash.evidence[0].startswith("GPU ")


def test_no_driver_is_not_available_never_a_crash(tmp_path):
    watch = AttemptEvidence(os.getpid(), "run-n", 0.0, lambda: True, nv=FakeNvml(fail_init=True), gpus=[0],
                            sample_s=0.05, kernel=lambda: ([], None, "/dev/kmsg: Permission denied"))
    system = watch.collect({"output_dir": str(tmp_path)}, None)
    assert system.gpu_faults == () and system.kernel_log is None
    assert "NVML: not available: NVML error 9" in system.unavailable
    assert "kernel log: not available: /dev/kmsg: Permission denied" in system.unavailable
    # and the real pynvml on a machine without a driver says the same through LocalHost
    host = LocalHost(gpu.NullReader())
    t = host.launch(Command((sys.executable, "-c", "raise SystemExit(3)")), tmp_path / "t.log", "run-n", cwd=str(tmp_path))
    host.evidence_baseline(t, "run-n", [0])
    assert host.wait_exit(t, 60)
    system = host.evidence(t, {"output_dir": str(tmp_path)}, None)
    assert system.disks and system.gpu_faults == ()
    assert os.path.exists("/dev/nvidia0") or any(u.startswith("NVML: not available") for u in system.unavailable), system


# ---- kernel records: parsing and the journal fallback (stand-ins) --------------------------------
def test_kmsg_records_and_oom_lines():
    rec = parse_kmsg_record(b"3,1402,2795647186,-;Memory cgroup out of memory: Killed process 28112 (python3) "
                            b"total-vm:278728kB\n SUBSYSTEM=memory\n")
    assert rec == KernelLine(2795.647186, "Memory cgroup out of memory: Killed process 28112 (python3) total-vm:278728kB")
    assert parse_kmsg_record(b"garbage") is None
    lines = [KernelLine(10.0, "Out of memory: Killed process 7 (python) total-vm:1kB"),     # before the launch
             KernelLine(20.0, "oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/x,task=python3,pid=8,uid=0"),
             KernelLine(20.0, "Memory cgroup out of memory: Killed process 8 (python3) total-vm:1kB"),
             KernelLine(21.0, "Out of memory: Killed process 9 (sshd) total-vm:1kB")]          # not the run's
    kills = oom_kills(lines, {7, 8}, since_mono=15.0, wall_at=lambda m: 1000 + m)
    assert [(k.pid, k.comm, k.at) for k in kills] == [(8, "python3", 1020.0)] and "Killed process 8" in kills[0].line


def test_the_kernel_journal_when_kmsg_is_not_readable():
    def denied():
        raise PermissionError(13, "Permission denied")

    out = "[ 2795.647186] node1 kernel: Out of memory: Killed process 5 (python) total-vm:1kB\n-- Boot abc --\n"
    journal = lambda: evidence.read_journal_kernel(  # noqa: E731
        run=lambda argv, **kw: subprocess.CompletedProcess(argv, 0, out, ""))
    lines, source, why = kernel_lines((("/dev/kmsg", denied), ("journalctl -k", journal)))
    assert source == "journalctl -k" and why is None
    assert lines == [KernelLine(2795.647186, "Out of memory: Killed process 5 (python) total-vm:1kB")]
    failing = lambda: evidence.read_journal_kernel(  # noqa: E731
        run=lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "No journal files were found."))
    assert kernel_lines((("/dev/kmsg", denied), ("journalctl -k", failing))) == (
        [], None, "/dev/kmsg: Permission denied; journalctl -k: No journal files were found.")
