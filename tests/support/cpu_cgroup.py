"""A cgroup v1 CPU controller the tests can make cgroups in and set quotas on (the real slowdown tests)."""
from __future__ import annotations

import os
from pathlib import Path

CPU_V1 = Path("/sys/fs/cgroup/cpu")


def why_no_cpu_quota() -> str | None:
    """Why a test cannot make a cgroup and set its CPU quota here; None when it can."""
    if os.geteuid() != 0:
        return "needs root to make a cgroup and set its CPU quota"
    if not (CPU_V1 / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_V1}"
    return None
