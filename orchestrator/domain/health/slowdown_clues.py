"""What the machine's evidence at a throughput drop points at (host/slowdown_evidence.py reads it). Pure.

Each clue is one line for the journal event, the alert and `status`, strongest first: a GPU throttling
(thermal, power, hardware slowdown), errors on the GPU or its link (Xid, ECC, PCIe replays), the trainer's
cgroup CPU quota biting, a noisy neighbour (CPU steal), host memory pressure or swapping (CPU optimizer
offload), I/O wait, every CPU busy. A reading within normal bounds gives no clue: no clue is not "healthy",
`unavailable` says what could not be looked at.
"""
from __future__ import annotations

from orchestrator.types import SlowdownEvidence

# reasons that slow a busy GPU; "applications_clocks_setting", "sync_boost", "display_clock_setting" do not
SLOWING_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                             "hw_power_brake_slowdown"})
CLOCK_LOW = 0.8          # SM clock under this share of its maximum, with no reason given
STEAL_PCT = 5.0          # CPU steal (hypervisor): a neighbour takes the CPUs
IOWAIT_PCT = 20.0
BUSY_PCT = 95.0          # every CPU busy: the data loader or the offloaded optimizer waits for a CPU
PRESSURE_PCT = 10.0      # PSI memory "some" avg10: tasks stalled on memory this share of the time


def clues(ev: SlowdownEvidence) -> tuple[str, ...]:
    """The readings in `ev` that could explain a slowdown, one line each, strongest first."""
    out: list[str] = []
    for g in ev.gpus:
        why = sorted(SLOWING_REASONS & set(g.throttle_reasons))
        clock = (f"SM {g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz" if g.sm_clock_mhz is not None
                 and g.sm_clock_max_mhz else None)
        extra = ", ".join(x for x in (clock, None if g.temperature_c is None else f"{g.temperature_c} C",
                                      None if g.power_w is None or g.power_limit_w is None
                                      else f"{g.power_w:.0f}/{g.power_limit_w:.0f} W") if x)
        if why:
            out.append(f"GPU {g.index} throttled: {', '.join(why)} ({extra})")
        elif g.sm_clock_mhz is not None and g.sm_clock_max_mhz and g.sm_clock_mhz < CLOCK_LOW * g.sm_clock_max_mhz:
            out.append(f"GPU {g.index} clock low with no throttle reason: {extra}")
        out += [f"GPU {g.index}: Xid {x} since launch" for x in g.xids]
        if g.ecc_uncorrected:
            out.append(f"GPU {g.index}: {g.ecc_uncorrected} uncorrected ECC errors")
        if g.pcie_replays:
            out.append(f"GPU {g.index}: {g.pcie_replays} PCIe replays (a degraded link)")
    for c in ev.cgroups:
        if c.throttled_now:
            out.append(f"cgroup {c.path}: CPU quota {c.quota} throttled the trainer in {c.throttled_now} periods "
                       f"while sampled ({c.nr_throttled} in all)")
    if ev.cpu_steal_pct is not None and ev.cpu_steal_pct >= STEAL_PCT:
        out.append(f"CPU steal {ev.cpu_steal_pct:.0f}%: the hypervisor gives the CPUs to another guest")
    some = ev.memory_pressure.get("some_avg10")
    if some is not None and some >= PRESSURE_PCT:
        out.append(f"memory pressure: tasks stalled on memory {some:.0f}% of the last 10 s")
    if ev.swapped_pages_per_s:
        out.append(f"swapping {ev.swapped_pages_per_s:.0f} pages/s")
    if ev.cpu_iowait_pct is not None and ev.cpu_iowait_pct >= IOWAIT_PCT:
        out.append(f"I/O wait {ev.cpu_iowait_pct:.0f}% of CPU time")
    if ev.cpu_busy_pct is not None and ev.cpu_busy_pct >= BUSY_PCT:
        out.append(f"every CPU busy ({ev.cpu_busy_pct:.0f}%)")
    return tuple(out)
