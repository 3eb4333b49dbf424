"""System evidence about a failed attempt, read the way a person would look (dmesg, memory.events,
nvidia-smi, df, ss): kernel OOM kills of the run's processes, the memory cgroup's oom_kill counter,
NVML Xid events and ECC counters on the run's GPUs, free space and inodes, the rendezvous port's owner.

Every reader fails soft: no permission, no driver, no cgroup gives "<reader>: not available: <why>" in
SystemEvidence.unavailable, never an exception into the supervisor. What the facts mean is decided in
verdict.py (pure).
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from orchestrator.host.launch import local as launcher
from orchestrator.host.probe import existing_parent
from orchestrator.types import DiskSpace, GpuFault, OomKill, PortOwner, SystemEvidence

KMSG = "/dev/kmsg"
CGROUP_ROOT = Path("/sys/fs/cgroup")
SAMPLE_S = 2.0         # how often the run's pids are recorded (and the NVML event wait's timeout)
MARKER_EVERY = 5       # ... and every this many samples, the processes carrying the run marker too
JOURNALCTL_S = 10.0


# ---- kernel records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelLine:
    mono: float        # the kernel's timestamp: seconds since boot, on the CLOCK_MONOTONIC scale
    text: str


def parse_kmsg_record(rec: bytes) -> KernelLine | None:
    """One /dev/kmsg record: "prio,seq,usec,flags[,...];message\\n[ KEY=value\\n...]"."""
    head, sep, msg = rec.decode("utf-8", "replace").partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3 or not fields[2].isdigit():
        return None
    return KernelLine(int(fields[2]) / 1e6, msg.split("\n", 1)[0])


def read_kmsg(path: str = KMSG) -> list[KernelLine]:
    """The kernel ring buffer from its start, without blocking (each read() returns one record)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    out: list[KernelLine] = []
    try:
        while True:
            try:
                rec = os.read(fd, 16384)
            except BlockingIOError:
                break
            except BrokenPipeError:   # EPIPE: the record was overwritten meanwhile; the read goes on after it
                continue
            if not rec:
                break
            if (line := parse_kmsg_record(rec)) is not None:
                out.append(line)
    finally:
        os.close(fd)
    return out


_JOURNAL_LINE = re.compile(r"^\[\s*(\d+\.\d+)\]\s+\S+\s+kernel:\s?(.*)$")


def read_journal_kernel(run=subprocess.run) -> list[KernelLine]:
    """The kernel's messages of this boot from the journal (`journalctl -k`), where /dev/kmsg is not readable."""
    r = run(["journalctl", "-k", "-b", "-o", "short-monotonic", "--no-pager", "-q"], capture_output=True, text=True,
            timeout=JOURNALCTL_S, check=False)
    if r.returncode != 0:
        raise OSError(r.stderr.strip() or f"journalctl exited {r.returncode}")
    return [KernelLine(float(m.group(1)), m.group(2)) for s in r.stdout.splitlines() if (m := _JOURNAL_LINE.match(s))]


def kernel_lines(readers: tuple[tuple[str, Callable[[], list[KernelLine]]], ...] | None = None
                 ) -> tuple[list[KernelLine], str | None, str | None]:
    """(lines, source, why none): /dev/kmsg, else the kernel journal."""
    why = []
    for name, read in readers or (("/dev/kmsg", read_kmsg), ("journalctl -k", read_journal_kernel)):
        try:
            return read(), name, None
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            why.append(f"{name}: {getattr(e, 'strerror', None) or e}")
    return [], None, "; ".join(why)


_OOM_KILLED = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process (\d+) \(([^)]*)\)")
_OOM_KILL_INFO = re.compile(r"\boom-kill:.*\btask=([^,]*),pid=(\d+)")


def oom_kills(lines: list[KernelLine], pids: set[int], since_mono: float, wall_at=None) -> tuple[OomKill, ...]:
    """The OOM killer's kills of `pids` at or after since_mono, one per pid ("Killed process" preferred).
    `wall_at`: kernel timestamp -> wall clock (default: through the monotonic clock now)."""
    wall_at = wall_at or (lambda mono: time.time() - (time.monotonic() - mono))
    found: dict[int, OomKill] = {}
    for ln in lines:
        if ln.mono < since_mono:
            continue
        if m := _OOM_KILLED.search(ln.text):
            pid, comm, decisive = int(m.group(1)), m.group(2), True
        elif m := _OOM_KILL_INFO.search(ln.text):
            pid, comm, decisive = int(m.group(2)), m.group(1), False
        else:
            continue
        if pid in pids and (pid not in found or decisive and "oom-kill:" in found[pid].line):
            found[pid] = OomKill(pid, comm, wall_at(ln.mono), ln.text[:500])
    return tuple(found.values())


# ---- memory cgroup -------------------------------------------------------------------------------
def memory_cgroup(pid: int | str = "self", root: Path = CGROUP_ROOT) -> Path | None:
    """The memory cgroup directory of a process: v1's memory controller, else the v2 unified one."""
    v1 = v2 = None
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if "memory" in ctrls.split(","):
                v1 = root / "memory" / path.lstrip("/")
            elif hid == "0":
                v2 = root / path.lstrip("/")
    if v1 is not None and (v1 / "memory.oom_control").exists():
        return v1
    if v2 is not None and (v2 / "memory.events").exists():
        return v2
    return None


def oom_kill_count(cgroup: Path) -> int | None:
    """The cgroup's oom_kill counter (v2 memory.events, v1 memory.oom_control); None when it has none."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(m.group(1)) if m else None
    return None


# ---- disks and the port --------------------------------------------------------------------------
_REMOTE = re.compile(r"^[^/]+:")   # an rsync destination on another host (user@host:/path)


def disk_space(paths: dict[str, str]) -> tuple[list[DiskSpace], list[str]]:
    """Free bytes and inodes of each role's filesystem (statvfs, as `df -h` / `df -i` show)."""
    out, unavailable = [], []
    for role, path in paths.items():
        if _REMOTE.match(path):
            unavailable.append(f"disk {role}: not available: {path} is on another host")
            continue
        try:
            st = os.statvfs(existing_parent(Path(path)))
        except OSError as e:
            unavailable.append(f"disk {role}: not available: {e.strerror or e}")
            continue
        out.append(DiskSpace(role, path, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize,
                             st.f_favail if st.f_files else None))
    return out, unavailable


def port_owners(port: int, connections=psutil.net_connections) -> tuple[list[PortOwner], list[str]]:
    """Who listens on the port (pid and command line), as `ss -ltnp 'sport = :PORT'` shows."""
    try:
        conns = connections(kind="inet")
    except (psutil.Error, OSError) as e:
        return [], [f"port owner: not available: {e}"]
    pids = {c.pid for c in conns if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return [PortOwner(port, pid, launcher.cmdline(pid) if pid else "") for pid in sorted(pids, key=lambda p: p or 0)], []


# ---- NVML ----------------------------------------------------------------------------------------
class NvmlWatch:
    """ECC counters at launch and critical Xid events since, on the run's GPUs. `nv`: pynvml or a stand-in.
    `gpus`: NVML indices or GPU-UUID prefixes, as gpu.run_gpus gives them."""

    def __init__(self, nv, gpus: list[int | str]) -> None:
        self.nv, self.error, self.events_error = nv, None, None
        self.handles: dict[int, object] = {}
        self.ecc0: dict[int, int | None] = {}
        self.xids: list[tuple[int, int]] = []
        self.evset = None
        try:
            nv.nvmlInit()
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(h)).lower()
                if any(g == i if isinstance(g, int) else uuid.startswith(str(g).lower()) for g in gpus):
                    self.handles[i] = h
            self.ecc0 = {i: self._ecc(h) for i, h in self.handles.items()}
        except Exception as e:  # no library, no driver, a mismatch: all mean "cannot see"
            self.error = f"NVML: not available: {e}"
            return
        try:
            self.evset = nv.nvmlEventSetCreate()
            for h in self.handles.values():
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self.evset)
        except Exception as e:
            self.evset, self.events_error = None, f"NVML Xid events: not available: {e}"

    def _ecc(self, h) -> int | None:
        try:
            return int(self.nv.nvmlDeviceGetTotalEccErrors(h, self.nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                           self.nv.NVML_VOLATILE_ECC))
        except Exception:  # ECC off or not supported
            return None

    def wait(self, timeout_s: float) -> str:
        """Wait up to timeout_s for one Xid event: "event", "timeout", or "off" (no event set to wait on)."""
        if self.evset is None:
            return "off"
        nv = self.nv
        try:
            ev = nv.nvmlEventSetWait(self.evset, int(timeout_s * 1000))
        except Exception as e:
            if getattr(e, "value", None) == getattr(nv, "NVML_ERROR_TIMEOUT", object()):
                return "timeout"
            self.evset, self.events_error = None, f"NVML Xid events: not available: {e}"
            return "off"
        try:
            idx = int(nv.nvmlDeviceGetIndex(ev.device))
        except Exception:
            idx = -1
        self.xids.append((idx, int(ev.eventData)))
        return "event"

    def drain(self, limit: int = 100) -> None:
        """The events already queued (the crash may be younger than the reader's last wait)."""
        for _ in range(limit):
            if self.wait(0) != "event":
                return

    def faults(self) -> list[GpuFault]:
        out = [GpuFault(i, "xid", f"Xid {x}", x) for i, x in self.xids]
        for i, h in self.handles.items():
            before, after = self.ecc0.get(i), self._ecc(h)
            if before is not None and after is not None and after > before:
                out.append(GpuFault(i, "ecc", f"uncorrected ECC errors {before} -> {after}"))
        return out

    def close(self) -> None:
        try:
            if self.evset is not None:
                self.nv.nvmlEventSetFree(self.evset)
            if self.error is None:
                self.nv.nvmlShutdown()
        except Exception:
            pass


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def load_nvml():
    """pynvml, or None where it is not installed (the watch then says NVML is not available)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


# ---- one attempt ---------------------------------------------------------------------------------
class AttemptEvidence:
    """Taken at launch, gathered while the attempt runs, read at its end: the run's pids (the trainer's tree
    and what carries the run marker), the memory cgroups' oom_kill counters, NVML. A daemon thread samples
    until the trainer exits or `collect` is called."""

    def __init__(self, pid: int, run_id: str, since_mono: float, running: Callable[[], bool], *, nv=None,
                 gpus: list[int | str] = (), sample_s: float = SAMPLE_S, kernel=kernel_lines) -> None:
        self.pid, self.run_id, self.since, self.running = pid, run_id, since_mono, running
        self.sample_s, self.kernel = sample_s, kernel
        self.pids: dict[int, str] = {pid: ""}
        self.lock, self.done = threading.Lock(), threading.Event()
        self.unavailable: list[str] = []
        self.cgroups: dict[Path, int | None] = {}
        for who in ("self", pid):
            try:
                if (cg := memory_cgroup(who)) is not None and cg not in self.cgroups:
                    self.cgroups[cg] = oom_kill_count(cg)
            except (OSError, ValueError) as e:
                self.unavailable.append(f"memory cgroup of {who}: not available: {e}")
        if not self.cgroups and not self.unavailable:
            self.unavailable.append("memory cgroup: not available: no memory controller for this process")
        if nv is None:
            self.nvml = None
            self.unavailable.append("NVML: not available: " + ("no GPUs checked (gpu.check = false)" if not gpus
                                                               else "pynvml is not installed"))
        else:
            self.nvml = NvmlWatch(nv, list(gpus)) if gpus else None
            if not gpus:
                self.unavailable.append("NVML: not available: no GPUs checked (gpu.check = false)")
        self.sample(marker=True)
        self.thread = threading.Thread(target=self._run, name=f"evidence-{pid}", daemon=True)
        self.thread.start()

    def sample(self, marker: bool = False) -> None:
        """Record the run's live pids (a process the kernel kills later is known by then)."""
        procs = launcher.tree(self.pid) + (launcher.run_processes(self.run_id) if marker else [])
        seen = {}
        for p in procs:
            try:
                seen[p.pid] = p.name()
            except psutil.Error:
                seen[p.pid] = ""
        with self.lock:
            self.pids.update(seen)

    def _run(self) -> None:
        n = 0
        while not self.done.is_set() and self.running():
            n += 1
            self.sample(marker=n % MARKER_EVERY == 0)
            if not self.nvml or self.nvml.wait(self.sample_s) == "off":
                self.done.wait(self.sample_s)

    def collect(self, paths: dict[str, str], port: int | None) -> SystemEvidence:
        """Everything at the attempt's end. Stops the sampler; never raises."""
        self.done.set()
        self.thread.join(self.sample_s + 1.0)   # out of NVML's event wait before the set is drained and freed
        unavailable = list(self.unavailable)
        try:
            self.sample(marker=True)   # a hung trainer's processes are all still there
        except Exception:
            pass
        with self.lock:
            pids = set(self.pids)
        lines, source, why = self.kernel()
        kills = oom_kills(lines, pids, self.since) if source else ()
        if why:
            unavailable.append(f"kernel log: not available: {why}")
        counters = []
        for cg, before in self.cgroups.items():
            after = oom_kill_count(cg)
            if before is not None and after is not None and after > before:
                counters.append(f"memory cgroup {cg}: oom_kill {before} -> {after}")
        faults: list[GpuFault] = []
        if self.nvml is not None:
            self.nvml.drain()
            faults = self.nvml.faults()
            unavailable += [e for e in (self.nvml.error, self.nvml.events_error) if e]
            self.nvml.close()
        disks, why_disks = disk_space(paths)
        owners, why_port = port_owners(port) if port is not None else ([], [])
        return SystemEvidence(kills, source, tuple(counters), tuple(faults), tuple(disks), tuple(owners),
                              tuple(unavailable + why_disks + why_port))
