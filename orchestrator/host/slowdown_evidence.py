"""The machine's evidence at a throughput drop, read the way a person would look (nvidia-smi -q, top's
%st and %wa, /proc/pressure/memory, free, the cgroup's cpu.stat): per GPU clocks and throttle reasons,
temperature, power, ECC and PCIe replay counters, Xid events since launch; host CPU busy / steal /
iowait shares, load, memory pressure and swap; the CPU throttling of the trainer's cgroups.

Counters that only mean something as a rate (CPU times, swapping, cgroup throttled periods) are read
twice, `interval_s` apart. Every reader fails soft: what could not be read is named in
SlowdownEvidence.unavailable ("<source>: not available: <why>"), never raised into the supervisor.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from orchestrator.types import CgroupCpu, GpuHealth, SlowdownEvidence

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
INTERVAL_S = 0.5

# NVML's clock event (throttle) reason bits (nvml.h nvmlClocksEventReason*), without the idle bit
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"), (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"))
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


# ---- /proc ---------------------------------------------------------------------------------------
def parse_proc_stat(text: str) -> dict[str, int]:
    """The aggregate `cpu` line of /proc/stat as jiffies per field (guest time is inside user already)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:]]
            return dict(zip(_CPU_FIELDS, vals + [0] * (len(_CPU_FIELDS) - len(vals))))
    raise ValueError("no aggregate cpu line")


def cpu_shares(before: dict[str, int], after: dict[str, int]) -> tuple[float, float, float] | None:
    """(busy %, steal %, iowait %) of all CPUs between two /proc/stat reads; None when no time passed."""
    d = {k: after[k] - before[k] for k in _CPU_FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = total - d["idle"] - d["iowait"] - d["steal"]
    return 100.0 * busy / total, 100.0 * d["steal"] / total, 100.0 * d["iowait"] / total


def parse_pressure(text: str) -> dict[str, float]:
    """/proc/pressure/memory ("some avg10=1.00 avg60=... total=N") -> {"some_avg10": 1.0, ...} (no totals)."""
    out = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            key, _, val = pair.partition("=")
            if key != "total":
                out[f"{kind}_{key}"] = float(val)
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> bytes per field."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def parse_vmstat(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


# ---- the trainer's CPU cgroups -------------------------------------------------------------------
def cpu_cgroup(pid: int | str, proc: Path = PROC, root: Path = CGROUP_ROOT) -> tuple[Path, int] | None:
    """The CPU cgroup directory of a process and its version: v1's cpu controller (mounted as cpu or
    cpu,cpuacct), else the v2 unified hierarchy. None where neither has a cpu.stat."""
    v1: list[Path] = []
    v2 = None
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        names = ctrls.split(",")
        if "cpu" in names:
            v1 += [root / mount / path.lstrip("/") for mount in dict.fromkeys(("cpu", ctrls, "cpu,cpuacct"))]
        elif hid == "0":
            v2 = root / path.lstrip("/")
    for d in v1:
        if (d / "cpu.stat").exists():
            return d, 1
    if v2 is not None and (v2 / "cpu.stat").exists():
        return v2, 2
    return None


def parse_cpu_stat(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


def cgroup_quota(cg: Path, version: int) -> str:
    """The cgroup's CPU limit as "quota/period" in microseconds, or "max" (none)."""
    if version == 2:
        quota, _, period = (cg / "cpu.max").read_text().strip().partition(" ")
        return "max" if quota == "max" else f"{quota}/{period}"
    quota = (cg / "cpu.cfs_quota_us").read_text().strip()
    return "max" if quota.startswith("-") else f"{quota}/{(cg / 'cpu.cfs_period_us').read_text().strip()}"


def cgroup_cpu(cg: Path, version: int, before: dict[str, int] | None, stat: dict[str, int]) -> CgroupCpu:
    """One cgroup's throttling: v1 cpu.stat (nr_periods, nr_throttled, throttled_time ns), v2 (..., throttled_usec)."""
    try:
        quota = cgroup_quota(cg, version)
    except OSError:
        quota = "unknown"
    throttled = (stat["throttled_time"] / 1e9 if "throttled_time" in stat
                 else stat["throttled_usec"] / 1e6 if "throttled_usec" in stat else None)
    now = (stat["nr_throttled"] - before["nr_throttled"]
           if before is not None and "nr_throttled" in stat and "nr_throttled" in before else None)
    return CgroupCpu(str(cg), version, quota, stat.get("nr_periods"), stat.get("nr_throttled"), throttled, now)


# ---- NVML ----------------------------------------------------------------------------------------
def _call(fn: Callable, *args):
    try:
        return fn(*args)
    except Exception:  # not supported on this GPU, or the driver refused: the field says None
        return None


def gpu_health(nv, handles: dict[int, object], xids: Iterable[tuple[int, int]] = ()) -> list[GpuHealth]:
    """Each GPU's clocks, throttle reasons, temperature, power, ECC and PCIe replay counters through NVML
    (`nv`: pynvml or a stand-in), with the Xid events `xids` ((gpu, xid) pairs) seen on it."""
    seen = list(xids)
    out = []
    for i, h in sorted(handles.items()):
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = _call(reasons_fn, h)
        power, limit = _call(nv.nvmlDeviceGetPowerUsage, h), _call(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        ecc = [_call(nv.nvmlDeviceGetTotalEccErrors, h, kind, nv.NVML_VOLATILE_ECC)
               for kind in (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED)]
        out.append(GpuHealth(
            i, _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM), _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
            tuple(name for bit, name in THROTTLE_REASONS if mask is not None and int(mask) & bit),
            _call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            None if power is None else power / 1000.0, None if limit is None else limit / 1000.0,
            None if ecc[0] is None else int(ecc[0]), None if ecc[1] is None else int(ecc[1]),
            _call(nv.nvmlDeviceGetPcieReplayCounter, h), tuple(x for g, x in seen if g == i)))
    return out


def nvml_handles(nv, gpus: Iterable[int | str]) -> dict[int, object]:
    """NVML handles of the run's GPUs (indices or GPU-UUID prefixes), after nvmlInit."""
    nv.nvmlInit()
    want, out = list(gpus), {}
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = nv.nvmlDeviceGetUUID(h)
        uuid = (uuid.decode() if isinstance(uuid, bytes) else uuid).lower()
        if any(g == i if isinstance(g, int) else uuid.startswith(str(g).lower()) for g in want):
            out[i] = h
    return out


# ---- all of it -----------------------------------------------------------------------------------
def _read(path: Path, parse: Callable[[str], object], name: str, why: list[str]):
    try:
        return parse(path.read_text())
    except (OSError, ValueError) as e:
        why.append(f"{name}: not available: {getattr(e, 'strerror', None) or e}")
        return None


def read(pids: Iterable[int], *, gpus: list[GpuHealth] | None = None, gpu_why: str | None = None,
         proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, interval_s: float = INTERVAL_S,
         sleep: Callable[[float], None] = time.sleep, now: Callable[[], float] = time.time) -> SlowdownEvidence:
    """The evidence now: `pids` are the trainer's processes (their distinct CPU cgroups are read), `gpus`
    what gpu_health() said (None: NVML not read, `gpu_why` says why). Blocks for `interval_s`. Never raises."""
    why: list[str] = [] if gpus is not None else [f"NVML: not available: {gpu_why or 'not read'}"]
    cgs: dict[Path, int] = {}
    for pid in pids:
        try:
            if (found := cpu_cgroup(pid, proc, cgroup_root)) is not None:
                cgs.setdefault(*found)
        except (OSError, ValueError) as e:
            why.append(f"cgroup of pid {pid}: not available: {getattr(e, 'strerror', None) or e}")
    if not cgs and not any(w.startswith("cgroup") for w in why):
        why.append("CPU cgroup: not available: no cpu.stat for the trainer's processes")

    def sample(w: list[str]) -> tuple[dict | None, dict | None, dict[Path, dict[str, int]]]:
        stats = {}
        for cg in cgs:
            try:
                stats[cg] = parse_cpu_stat((cg / "cpu.stat").read_text())
            except (OSError, ValueError) as e:
                w.append(f"cgroup {cg}: not available: {getattr(e, 'strerror', None) or e}")
        return _read(proc / "stat", parse_proc_stat, "/proc/stat", w), _read(proc / "vmstat", parse_vmstat,
                                                                             "/proc/vmstat", w), stats

    stat0, vm0, cg0 = sample([])
    t0 = time.monotonic()
    sleep(interval_s)
    stat1, vm1, cg1 = sample(why)
    dt = max(time.monotonic() - t0, interval_s) or 1.0
    shares = cpu_shares(stat0, stat1) if stat0 and stat1 else None
    swapped = None
    if vm0 and vm1 and all(k in vm0 and k in vm1 for k in ("pswpin", "pswpout")):
        swapped = (vm1["pswpin"] - vm0["pswpin"] + vm1["pswpout"] - vm0["pswpout"]) / dt
    load = _read(proc / "loadavg", lambda t: tuple(float(x) for x in t.split()[:3]), "/proc/loadavg", why)
    mem = _read(proc / "meminfo", parse_meminfo, "/proc/meminfo", why) or {}
    pressure: dict[str, float] = {}
    if (proc / "pressure" / "memory").exists():
        pressure = _read(proc / "pressure" / "memory", parse_pressure, "/proc/pressure/memory", why) or {}
    else:
        why.append("/proc/pressure/memory: not available: no PSI in this kernel")
    swap = mem["SwapTotal"] - mem["SwapFree"] if "SwapTotal" in mem and "SwapFree" in mem else None
    busy, steal, iowait = shares if shares else (None, None, None)
    return SlowdownEvidence(
        now(), tuple(gpus or ()), cpu_busy_pct=busy, cpu_steal_pct=steal, cpu_iowait_pct=iowait, load_avg=load,
        memory_pressure=pressure, mem_available_bytes=mem.get("MemAvailable"), swap_used_bytes=swap,
        swapped_pages_per_s=swapped,
        cgroups=tuple(cgroup_cpu(cg, v, cg0.get(cg), cg1[cg]) for cg, v in cgs.items() if cg in cg1),
        unavailable=tuple(why))
