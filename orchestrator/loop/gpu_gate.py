"""The GPU side of VERIFYING and of the readiness wait: are the run's GPUs clear (NVML through the host), and
if not, which holders may be killed: this run's own leftovers, and foreign processes only where the recipe
allows them by pattern (gpu.kill_patterns), never others.

Multi-node (SlurmHost): every node of the job is checked in one step before each launch; a node whose GPUs
stay bad, or that keeps failing with cuda_fatal, is excluded: the job requeues itself without it
(domain/exclude.py decides; the journal and the node_excluded alert say so)."""
from __future__ import annotations

import re

from orchestrator.config.recipe import Recipe
from orchestrator.domain import exclude
from orchestrator.host import gpu
from orchestrator.host.base import Host
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.types import Alert, GpuSnapshot


class GpuGate:
    def __init__(self, recipe: Recipe, host: Host, metrics: Metrics):
        self.recipe, self.host, self.metrics = recipe, host, metrics
        self.bad_since: dict[str, float] = {}   # node -> monotonic time its GPUs were first seen not clear
        self.exclusion_failed = False           # a requeue Slurm refused is not tried again by this supervisor

    def run_gpus(self) -> list[int | str]:
        """The GPUs the run uses: indices or UUIDs from CUDA_VISIBLE_DEVICES, else 0..nproc-1."""
        return gpu.run_gpus(self.recipe.parallel.nproc_per_node, self.recipe.env.vars.get("CUDA_VISIBLE_DEVICES"))

    def verdict(self, snap: GpuSnapshot) -> tuple[bool, list[str]]:
        self.metrics.gpu_memory(snap)
        clear, problems = gpu.clear_verdict(snap, self.run_gpus(), self.recipe.gpu.clear_threshold_mib)
        nodes = self.host.node_gpu_problems(self.run_gpus(), self.recipe.gpu.clear_threshold_mib)  # {}: one node
        now = self.host.monotonic()
        self.bad_since = {n: self.bad_since.get(n, now) for n in nodes}
        problems = problems + [f"{n}: {p}" for n, ps in sorted(nodes.items()) for p in ps]
        clear = clear and not nodes
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

    def exclude_stuck_node(self, journal: Journal) -> bool:
        """Multi-node: a node that stays bad is left out: the job is requeued without it (True: this supervisor
        must stop; Slurm starts the next one on the remaining nodes). False on one node, or nothing to exclude."""
        nodes = self.host.nodes()
        if len(nodes) < 2 or self.exclusion_failed:
            return False
        s, now = self.recipe.supervisor, self.host.monotonic()
        found = exclude.node_to_exclude(nodes, {n: now - t for n, t in self.bad_since.items()},
                                        max(s.wait_s, s.force_wait_s),
                                        [(a.node, a.cls) for a in journal.attempts()])
        if found is None:
            return False
        journal.event("node_excluded", f"{found.reason}: requeueing the job without {found.node}", node=found.node)
        self.metrics.alert(Alert.NODE_EXCLUDED, True)
        try:
            excluded = self.host.exclude_node(found.node)
        except Exception as e:  # a job Slurm will not requeue (salloc, JobRequeue off): carry on as before
            self.exclusion_failed = True
            journal.event("node_excluded", f"could not requeue without {found.node}: {e}; exclude it by hand "
                          "(runbooks/slurm.md)", node=found.node, failed=True)
            return False
        journal.event("node_excluded", f"job requeued; excluded nodes now {excluded}", node=found.node,
                      excluded=excluded)
        return True
