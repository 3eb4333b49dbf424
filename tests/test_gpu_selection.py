"""CUDA_VISIBLE_DEVICES as GPU UUIDs or MIG ids, through a supervised run (NVML stand-in, fake trainer)."""
from __future__ import annotations

import threading

import pytest

from orchestrator.config.recipe import RecipeError, load
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import ExitCode, GpuInfo, GpuProcess, GpuSnapshot
from supervised import attempts, events, fake_recipe, wait_for

FOREIGN = 999_999  # a pid outside the run, never matched by a kill pattern: spared


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444455556666"


class HalfHeld:
    """16 GPUs; 0..7 are held by a foreign process, 8..15 are idle."""

    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(gpus=tuple(
            GpuInfo(i, "H200", 141 << 30, (30 << 30) if i < 8 else 0,
                    (GpuProcess(FOREIGN, 30 << 30),) if i < 8 else (), uuid(i)) for i in range(16)))


def supervisor(tmp_path, visible: str) -> Supervisor:
    recipe = fake_recipe(tmp_path, iterations=10, env={"vars": {"CUDA_VISIBLE_DEVICES": visible}})
    return Supervisor(load(recipe, ["gpu.check=true", "supervisor.backoff_max_s=0.2"]), gpu_reader=HalfHeld(),
                      install_signals=False)


def test_uuids_of_idle_gpus_are_the_ones_verified(tmp_path):
    """Checking GPUs 0..7 instead (the old behaviour) would wait for the foreign holder forever."""
    sup = supervisor(tmp_path, ",".join(uuid(i) for i in range(8, 16)))
    assert sup.run() == ExitCode.OK
    assert len(attempts(tmp_path / "out")) == 1 and not events(tmp_path / "out", "gpus_not_clear")


def test_a_uuid_of_a_held_gpu_holds_the_launch_back(tmp_path):
    sup = supervisor(tmp_path, f"{uuid(9)},{uuid(3)},10,11,12,13,14,15")
    t = threading.Thread(target=sup.run)
    t.start()
    try:
        refused = wait_for(lambda: len(events(tmp_path / "out", "gpus_not_clear")) >= 2, 30)
    finally:
        sup.request_stop("test over")
        t.join(60)
    assert refused and not t.is_alive()
    assert not attempts(tmp_path / "out"), "never launched onto a busy GPU"
    problems = " ".join(e["message"] for e in events(tmp_path / "out", "gpus_not_clear"))
    assert f"{uuid(3)}: held by pid {FOREIGN}" in problems and uuid(9) not in problems


@pytest.mark.parametrize("visible", ["MIG-5e6f7a8b-1111-2222-3333-444455556666", "0,MIG-GPU-00000001/1/0"])
def test_mig_ids_are_refused_at_pre_flight(tmp_path, visible):
    sup = supervisor(tmp_path, visible)
    with pytest.raises(RecipeError, match="pre-flight gpus: .*is a MIG instance"):
        sup.run()
    assert not attempts(tmp_path / "out")
