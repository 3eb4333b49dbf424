"""What the evidence at a throughput drop points at (domain/health/slowdown_clues.py): table, false positives first."""
from __future__ import annotations

import pytest

from orchestrator.domain.health.slowdown_clues import clues
from orchestrator.types import CgroupCpu, GpuHealth, SlowdownEvidence

HEALTHY_GPU = GpuHealth(0, 1980, 1980, 2619, (), 65, 550.0, 700.0, 0, 12, 0)
CALM = dict(cpu_busy_pct=40.0, cpu_steal_pct=0.5, cpu_iowait_pct=2.0, memory_pressure={"some_avg10": 0.3},
            swapped_pages_per_s=0.0)


def ev(**kw) -> SlowdownEvidence:
    return SlowdownEvidence(0.0, **{**CALM, **kw})


@pytest.mark.parametrize("evidence, expect", [
    # false positives: a busy, healthy machine; counters that mean nothing here; nothing read at all
    (ev(gpus=(HEALTHY_GPU,)), ()),
    (ev(gpus=(GpuHealth(0, 1700, 1980, throttle_reasons=("applications_clocks_setting",)),)), ()),  # 86 %: boost
    (ev(gpus=(GpuHealth(0, 1980, 1980, ecc_corrected=500),)), ()),        # corrected ECC: the code did its job
    (ev(cgroups=(CgroupCpu("/sys/fs/cgroup/cpu/x", 1, "max", 10, 3, 0.1, 0),)), ()),   # throttled long ago only
    (ev(cpu_steal_pct=2.0, cpu_iowait_pct=10.0, cpu_busy_pct=90.0, memory_pressure={"some_avg10": 5.0}), ()),
    (SlowdownEvidence(0.0, unavailable=("NVML: not available: x",)), ()),
    # clues
    (ev(gpus=(GpuHealth(1, 1200, 1980, temperature_c=91, power_w=650.0, power_limit_w=700.0,
                        throttle_reasons=("hw_thermal_slowdown", "gpu_idle")),)),
     ("GPU 1 throttled: hw_thermal_slowdown (SM 1200/1980 MHz, 91 C, 650/700 W)",)),
    (ev(gpus=(GpuHealth(0, 900, 1980),)), ("GPU 0 clock low with no throttle reason: SM 900/1980 MHz",)),
    (ev(gpus=(GpuHealth(2, xids=(79,), ecc_uncorrected=2, pcie_replays=40),)),
     ("GPU 2: Xid 79 since launch", "GPU 2: 2 uncorrected ECC errors", "GPU 2: 40 PCIe replays (a degraded link)")),
    (ev(cgroups=(CgroupCpu("/sys/fs/cgroup/cpu/t", 1, "10000/100000", 120, 80, 9.5, 5),)),
     ("cgroup /sys/fs/cgroup/cpu/t: CPU quota 10000/100000 throttled the trainer in 5 periods while sampled "
      "(80 in all)",)),
    (ev(cpu_steal_pct=12.0), ("CPU steal 12%: the hypervisor gives the CPUs to another guest",)),
    (ev(memory_pressure={"some_avg10": 30.0}, swapped_pages_per_s=500.0),
     ("memory pressure: tasks stalled on memory 30% of the last 10 s", "swapping 500 pages/s")),
    (ev(cpu_iowait_pct=35.0, cpu_busy_pct=99.0), ("I/O wait 35% of CPU time", "every CPU busy (99%)")),
])
def test_clues(evidence, expect):
    assert clues(evidence) == expect
