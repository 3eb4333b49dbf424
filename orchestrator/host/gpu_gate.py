"""The GPU side of VERIFYING and of the readiness wait: are the run's GPUs clear (NVML through the host), and
if not, which holders may be killed: this run's own leftovers, and foreign processes only where the recipe
allows them by pattern (gpu.kill_patterns), never others."""
from __future__ import annotations

import re

from orchestrator.config.recipe import Recipe
from orchestrator.host import gpu
from orchestrator.host.base import Host
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.types import GpuSnapshot


class GpuGate:
    def __init__(self, recipe: Recipe, host: Host, metrics: Metrics):
        self.recipe, self.host, self.metrics = recipe, host, metrics

    def run_gpus(self) -> list[int | str]:
        """The GPUs the run uses: indices or UUIDs from CUDA_VISIBLE_DEVICES, else 0..nproc-1."""
        return gpu.run_gpus(self.recipe.parallel.nproc_per_node, self.recipe.env.vars.get("CUDA_VISIBLE_DEVICES"))

    def verdict(self, snap: GpuSnapshot) -> tuple[bool, list[str]]:
        self.metrics.gpu_memory(snap)
        clear, problems = gpu.clear_verdict(snap, self.run_gpus(), self.recipe.gpu.clear_threshold_mib)
        self.metrics.gpus_clear(clear, self.host.now())
        return clear, problems

    def clear(self, snap: GpuSnapshot, problems: list[str], run_id: str, journal: Journal) -> None:
        own = set(self.host.leftovers(run_id))
        foreign = gpu.holders(snap, self.run_gpus()) - own
        allowed = [pid for pid in foreign
                   if any(re.search(pat, self.host.cmdline(pid)) for pat in self.recipe.gpu.kill_patterns)]
        self.host.kill(sorted(own | set(allowed)))
        journal.event("gpus_not_clear", "; ".join(problems), killed_own=sorted(own), killed_foreign=allowed,
                      spared_foreign=sorted(foreign - set(allowed)))
