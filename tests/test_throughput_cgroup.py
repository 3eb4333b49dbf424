"""Throughput health against a real slowdown: a CPU-bound stand-in trainer whose cgroup v1 CPU quota is cut
mid-run (as the issue's e2e test does to the real trainer), fed to the tracker by the times its step lines
are read, the machine's evidence taken at the drop, then the quota restored. As root with a cgroup v1 cpu
controller; skipped with the reason otherwise. About 10-20 s."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.types import HealthKind
from orchestrator.domain.health.slowdown_clues import clues
from orchestrator.domain.health.throughput import ThroughputParams, ThroughputTracker
from orchestrator.host import slowdown_evidence as se
from cpu_cgroup import CPU_V1, why_no_cpu_quota

# a step: a fixed amount of CPU work, then its step line (what a trainer's progress line is to the supervisor)
TRAINER = "import sys\nfor s in range(1, 10**7):\n    sum(range(20000))\n    print(s, flush=True)\n"


@pytest.mark.skipif(why_no_cpu_quota() is not None, reason=str(why_no_cpu_quota()))
def test_a_cut_cpu_quota_is_a_throughput_drop_with_the_cgroup_as_evidence_then_recovers():
    cg = CPU_V1 / f"orchestrator-throughput-{os.getpid()}"
    cg.mkdir()
    child = None
    tr = ThroughputTracker(ThroughputParams.from_health(1.5, 2.0))   # the recipe's keys, a short window
    found: list = []
    lock, got = threading.Lock(), threading.Event()

    def read(pipe) -> None:
        for line in pipe:
            f = tr.observe(int(line), time.monotonic())
            if f:
                with lock:
                    found.extend(f)
                got.set()

    def wait_for(kind: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with lock:
                if any(f.kind == kind for f in found):
                    return
            got.wait(0.2)
            got.clear()
        pytest.fail(f"no {kind} within {timeout_s} s: found {found}, ratio {tr.ratio}, baseline {tr.baseline_s}")

    try:
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("-1")
        child = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True)
        (cg / "cgroup.procs").write_text(str(child.pid))
        reader = threading.Thread(target=read, args=(child.stdout,), daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while tr.baseline_s is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tr.baseline_s is not None, "no baseline in 30 s"
        time.sleep(1.0)
        assert found == [], "no drop before the quota is cut"

        (cg / "cpu.cfs_quota_us").write_text("4000")   # 4 % of a CPU
        wait_for(HealthKind.THROUGHPUT_DROP, 30)
        ev = se.read([child.pid], gpus=[], interval_s=0.5)
        (mine,) = [c for c in ev.cgroups if c.path == str(cg)]
        assert mine.quota == "4000/100000" and mine.throttled_now and mine.throttled_now > 0
        assert any(c.startswith(f"cgroup {cg}: CPU quota 4000/100000 throttled the trainer") for c in clues(ev))
        drop = next(f for f in found if f.kind == HealthKind.THROUGHPUT_DROP)
        assert drop.details["ratio"] > 1.5 and drop.details["window_s"] >= 2.0

        (cg / "cpu.cfs_quota_us").write_text("-1")
        wait_for(HealthKind.THROUGHPUT_RECOVERED, 30)
        assert [f.kind for f in found] == [HealthKind.THROUGHPUT_DROP, HealthKind.THROUGHPUT_RECOVERED]
        rec = found[1]
        assert rec.since == drop.since and rec.at is not None and drop.at is not None and rec.at > drop.at   # the slow spell: a goodput "slow" span
    finally:
        if child is not None:
            child.kill()
            child.wait()
            child.stdout.close()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not cg.exists()
