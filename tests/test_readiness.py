"""The verified-ready wait: the pure verdict (table), and the real probes behind it: NCCL segments
in a tmpfs directory mapped by a real process, and the page-cache warmer on real files."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrator.host import pagecache, shm
from orchestrator.domain.policy import READY_POLL_S, Readiness, readiness_verdict, settle_floor
from orchestrator.config.recipe import SupervisorSection
from orchestrator.types import CrashClass

CLEAR = dict(leftovers=[], gpu_problems=[], shm_held={}, port_free=True)


@pytest.mark.parametrize("elapsed, floor, bound, world, go, why, recheck", [
    (0.0, 0.0, 90.0, {}, True, (), 0.0),                                               # all clear at once
    (0.0, 30.0, 120.0, {}, False, ("nccl settle floor 30 s",), 30.0),                  # the floor: wake at it
    (29.0, 30.0, 120.0, {}, False, ("nccl settle floor 30 s",), 1.0),
    (30.0, 30.0, 120.0, {}, True, (), 0.0),
    (5.0, 0.0, 90.0, {"leftovers": [41, 42]}, False, ("2 process(es) of the run still alive (pids 41, 42)",), READY_POLL_S),
    (5.0, 0.0, 90.0, {"gpu_problems": ["GPU 0: held by pid 7"]}, False, ("GPU: GPU 0: held by pid 7",), READY_POLL_S),
    (5.0, 0.0, 90.0, {"shm_held": {"nccl-x": [9]}}, False, ("shm nccl-x still mapped by pid 9",), READY_POLL_S),
    (5.0, 0.0, 90.0, {"port_free": False}, False, ("no free rendezvous port in port_range",), READY_POLL_S),
    (89.9, 0.0, 90.0, {"leftovers": [41]}, False, ("1 process(es) of the run still alive (pids 41)",), pytest.approx(0.1)),
    (90.0, 0.0, 90.0, {"leftovers": [41]}, True, ("1 process(es) of the run still alive (pids 41)",), 0.0),  # the bound
    (0.0, 0.0, 0.0, {"port_free": False}, True, ("no free rendezvous port in port_range",), 0.0),  # wait_s = 0
])
def test_readiness_verdict(elapsed, floor, bound, world, go, why, recheck):
    r = readiness_verdict(elapsed, floor, bound, **{**CLEAR, **world})
    assert r == Readiness(go, why, recheck)


@pytest.mark.parametrize("cls, floor", [(CrashClass.NCCL_ERROR, 30.0), (CrashClass.NCCL_TIMEOUT_HANG, 30.0),
                                        (CrashClass.HOST_OOM_KILLED, 0.0), (CrashClass.CUDA_FATAL, 0.0)])
def test_settle_floor(cls, floor):
    assert settle_floor(cls, SupervisorSection()) == floor


def test_a_segment_mapped_by_a_live_process_is_held_and_an_unmapped_one_is_orphaned(tmp_path):
    held, orphan, foreign = tmp_path / "nccl-held01", tmp_path / "nccl-orph01", tmp_path / "nccl-other1"
    for f in (held, orphan, foreign):
        f.write_bytes(b"\0" * 4096)
    (tmp_path / "torch_123").write_bytes(b"x")  # not NCCL's: never reported
    code = ("import mmap, sys, time; fs=[open(p, 'r+b') for p in sys.argv[1:]]; "
            "ms=[mmap.mmap(f.fileno(), 4096) for f in fs]; print('ok', flush=True); time.sleep(60)")
    run = subprocess.Popen([sys.executable, "-c", code, str(held)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", code, str(foreign)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "ok" and other.stdout.readline().strip() == "ok"
        found = shm.run_segments(str(tmp_path), {run.pid}, since=time.time() - 60)
        assert found == {"nccl-held01": [run.pid], "nccl-orph01": []}, "another job's mapped segment is not ours"
        assert shm.run_segments(str(tmp_path), {run.pid}, since=None) == {"nccl-held01": [run.pid]}, \
            "created before this host launched the run: only what the run maps is its"
        run.kill()
        run.wait()
        assert shm.run_segments(str(tmp_path), set(), since=time.time() - 60) == {"nccl-held01": [], "nccl-orph01": []}
        shm.remove(str(tmp_path), ["nccl-held01", "nccl-orph01", "../escape"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["nccl-other1", "torch_123"]
    finally:
        for p in (run, other):
            p.kill()
            p.wait()


def test_the_warmer_reads_weight_files_within_its_budget_and_stops(tmp_path):
    for name, size in (("model-1.safetensors", 3 << 20), ("model-2.safetensors", 1 << 20), ("config.json", 10)):
        (tmp_path / name).write_bytes(os.urandom(size))
    files = pagecache.weight_files(tmp_path)
    assert [f.name for f in files] == ["model-1.safetensors", "model-2.safetensors"], "weights only, largest first"
    w = pagecache.Warmer(files)
    w.start()
    w.thread.join(10)
    assert w.stop() == 4 << 20
    bounded = pagecache.Warmer(files, budget_bytes=2 << 20)
    bounded.start()
    bounded.thread.join(10)
    assert bounded.stop() == 2 << 20, "never more than the memory budget"
    stopped = pagecache.Warmer(files)
    stopped.stopped.set()
    stopped.start()
    assert stopped.stop() == 0
