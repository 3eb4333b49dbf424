"""The machine's evidence at a throughput drop (host/slowdown_evidence.py): stand-in /proc, cgroup dirs
and NVML; one real read of this machine; a real CPU-quota cgroup (cgroup v1, as root)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.host import slowdown_evidence as se
from orchestrator.host.base import LocalHost
from orchestrator.host.gpu import NullReader
from fake_host import FakeHost
from cpu_cgroup import CPU_V1, why_no_cpu_quota

STAT0 = "cpu  1000 0 500 8000 100 0 0 0 0 0\ncpu0 1000 0 500 8000 100 0 0 0 0 0\nintr 1\n"
STAT1 = "cpu  1300 0 600 8300 200 0 0 100 0 0\ncpu0 1300 0 600 8300 200 0 0 100 0 0\nintr 2\n"
MEMINFO = "MemTotal:       1000 kB\nMemAvailable:    400 kB\nSwapTotal:      2000 kB\nSwapFree:       1500 kB\n"
PRESSURE = ("some avg10=12.50 avg60=3.00 avg300=1.00 total=123\n"
            "full avg10=4.00 avg60=1.00 avg300=0.50 total=45\n")


def fake_proc(tmp_path: Path, *, pid: int, cgroup: str, pressure: bool = True) -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / "stat").write_text(STAT0)
    (proc / "vmstat").write_text("pswpin 10\npswpout 20\n")
    (proc / "loadavg").write_text("3.50 2.00 1.00 2/300 999\n")
    (proc / "meminfo").write_text(MEMINFO)
    if pressure:
        (proc / "pressure").mkdir()
        (proc / "pressure" / "memory").write_text(PRESSURE)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    return proc


def fake_cgroup(root: Path, rel: str, stat: str, quota: tuple[str, str] | None = None, v2_max: str | None = None) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    (d / "cpu.stat").write_text(stat)
    if quota:
        (d / "cpu.cfs_quota_us").write_text(quota[0] + "\n")
        (d / "cpu.cfs_period_us").write_text(quota[1] + "\n")
    if v2_max:
        (d / "cpu.max").write_text(v2_max + "\n")
    return d


def advance(proc: Path, cg: Path | None, cg_stat: str | None):
    """A stand-in sleep: the world moves on between the two reads."""
    def sleep(_s: float) -> None:
        (proc / "stat").write_text(STAT1)
        if (proc / "vmstat").exists():
            (proc / "vmstat").write_text("pswpin 30\npswpout 50\n")
        if cg is not None and cg_stat is not None:
            (cg / "cpu.stat").write_text(cg_stat)
    return sleep


def test_cgroup_v1_throttling_cpu_shares_memory_and_swap(tmp_path):
    root = tmp_path / "cg"
    cg = fake_cgroup(root, "cpu,cpuacct/trainer", "nr_periods 100\nnr_throttled 10\nthrottled_time 2000000000\n",
                     quota=("50000", "100000"))
    proc = fake_proc(tmp_path, pid=42, cgroup="4:memory:/x\n3:cpu,cpuacct:/trainer\n0::/\n")
    ev = se.read([42], gpus=[], proc=proc, cgroup_root=root, interval_s=0.5, now=lambda: 7.0,
                 sleep=advance(proc, cg, "nr_periods 105\nnr_throttled 15\nthrottled_time 2500000000\n"))
    # cpu: 900 jiffies passed: busy 300+100, idle 300, iowait 100, steal 100
    assert ev.cpu_busy_pct == pytest.approx(400 / 900 * 100)
    assert ev.cpu_steal_pct == pytest.approx(100 / 900 * 100)
    assert ev.cpu_iowait_pct == pytest.approx(100 / 900 * 100)
    assert ev.load_avg == (3.5, 2.0, 1.0)
    assert ev.memory_pressure["some_avg10"] == 12.5 and ev.memory_pressure["full_avg10"] == 4.0
    assert "some_total" not in ev.memory_pressure
    assert ev.mem_available_bytes == 400 * 1024 and ev.swap_used_bytes == 500 * 1024
    assert ev.swapped_pages_per_s is not None and ev.swapped_pages_per_s > 0
    (c,) = ev.cgroups
    assert c.path == str(cg) and c.version == 1 and c.quota == "50000/100000"
    assert (c.nr_throttled, c.throttled_now, c.throttled_s) == (15, 5, 2.5)
    assert ev.at == 7.0 and ev.gpus == ()
    assert ev.unavailable == ()


def test_cgroup_v2_and_missing_sources_are_named(tmp_path):
    root = tmp_path / "cg"
    cg = fake_cgroup(root, "system.slice/train.scope", "usage_usec 5\nnr_periods 3\nnr_throttled 0\nthrottled_usec 0\n",
                     v2_max="max 100000")
    proc = fake_proc(tmp_path, pid=7, cgroup="0::/system.slice/train.scope\n", pressure=False)
    (proc / "vmstat").unlink()
    ev = se.read([7, 8], gpus=None, gpu_why="pynvml is not installed", proc=proc, cgroup_root=root,
                 sleep=advance(proc, cg, "usage_usec 9\nnr_periods 4\nnr_throttled 0\nthrottled_usec 0\n"))
    (c,) = ev.cgroups
    assert (c.version, c.quota, c.throttled_now, c.throttled_s) == (2, "max", 0, 0.0)
    why = "\n".join(ev.unavailable)
    assert "NVML: not available: pynvml is not installed" in why
    assert "/proc/pressure/memory: not available" in why
    assert "/proc/vmstat: not available" in why
    assert "cgroup of pid 8: not available" in why     # a pid that has gone
    assert ev.swapped_pages_per_s is None and ev.cpu_busy_pct is not None


def test_no_cpu_cgroup_is_said(tmp_path):
    proc = fake_proc(tmp_path, pid=5, cgroup="4:memory:/x\n")
    ev = se.read([5], gpus=[], proc=proc, cgroup_root=tmp_path / "none", sleep=lambda s: None)
    assert ev.cgroups == ()
    assert any(w.startswith("CPU cgroup: not available") for w in ev.unavailable)
    assert ev.cpu_busy_pct is None   # no time passed between the reads: no share, not 0 %


class FakeNvml:
    """pynvml's calls that gpu_health makes; GPU 1 supports neither power nor ECC."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU, NVML_VOLATILE_ECC = 1, 2, 0, 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_MEMORY_ERROR_TYPE_CORRECTED = 1, 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x40 | 0x1 if h == 0 else 0

    def nvmlDeviceGetClockInfo(self, h, kind):
        return {1: 1200 if h == 0 else 1980, 2: 2619}[kind]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetTemperature(self, h, kind):
        return 91 if h == 0 else 60

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 650_500

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 2 if kind == 1 else 17

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return 3 if h == 0 else 0


def test_gpu_health_reads_each_field_and_tolerates_unsupported_ones():
    g0, g1 = se.gpu_health(FakeNvml(), {0: 0, 1: 1}, xids=[(0, 79), (3, 48)])
    assert (g0.sm_clock_mhz, g0.sm_clock_max_mhz, g0.mem_clock_mhz) == (1200, 1980, 2619)
    assert g0.throttle_reasons == ("hw_thermal_slowdown",)        # gpu_idle is not a reason to show
    assert (g0.temperature_c, g0.power_w, g0.power_limit_w) == (91, 650.5, 700.0)
    assert (g0.ecc_uncorrected, g0.ecc_corrected, g0.pcie_replays, g0.xids) == (2, 17, 3, (79,))
    assert g1.throttle_reasons == () and g1.power_w is None and g1.ecc_uncorrected is None and g1.xids == ()


def test_older_pynvml_throttle_reasons_name():
    class Old(FakeNvml):
        nvmlDeviceGetCurrentClocksEventReasons = None

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            return 0x4

    (g,) = se.gpu_health(Old(), {0: 0})
    assert g.throttle_reasons == ("sw_power_cap",)


def test_real_read_of_this_machine():
    ev = se.read([os.getpid()], gpus=None, gpu_why="not asked", interval_s=0.2)
    assert ev.cpu_busy_pct is not None and 0 <= ev.cpu_busy_pct <= 100
    assert ev.load_avg is not None and ev.mem_available_bytes and ev.mem_available_bytes > 0
    # a source is either read or named unavailable, never silently empty
    assert ev.cgroups or any("cgroup" in w for w in ev.unavailable)
    assert ev.memory_pressure or any("pressure" in w for w in ev.unavailable)


def test_local_host_without_a_watch_says_so():
    class Launched:
        pid = os.getpid()

    ev = LocalHost(NullReader()).slowdown_evidence(Launched())
    assert any("NVML: not available: no evidence watch" in w for w in ev.unavailable)
    assert ev.cpu_busy_pct is not None


def test_fake_host_scripts_it():
    h = FakeHost()
    t = h.launch(__import__("orchestrator.types", fromlist=["Command"]).Command(("x",)), Path("/dev/null"), "r", "/")
    assert h.slowdown_evidence(t).unavailable and ("slowdown_evidence", t.pid) in h.calls


@pytest.mark.skipif(why_no_cpu_quota() is not None, reason=str(why_no_cpu_quota()))
def test_real_cpu_quota_cgroup_shows_throttling():
    """A busy child in a cgroup limited to 10% of a CPU: the reader finds that cgroup from the child's pid
    and sees nr_throttled rise over its sampling interval (what the CPU-quota e2e test relies on)."""
    cg = CPU_V1 / f"orchestrator-test-{os.getpid()}"
    cg.mkdir()
    child = None
    try:
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("10000")
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        (cg / "cgroup.procs").write_text(str(child.pid))
        time.sleep(0.3)   # let the quota bite before the first read
        ev = se.read([child.pid], gpus=[], interval_s=0.5)
        mine = [c for c in ev.cgroups if c.path == str(cg)]
        assert mine, (ev.cgroups, ev.unavailable)
        assert mine[0].quota == "10000/100000" and mine[0].version == 1
        assert mine[0].throttled_now and mine[0].throttled_now > 0
        assert mine[0].nr_throttled and mine[0].throttled_s and mine[0].throttled_s > 0
    finally:
        if child is not None:
            child.kill()
            child.wait()
        for _ in range(50):   # rmdir fails while the killed child is still being reaped into the parent cgroup
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not cg.exists()
