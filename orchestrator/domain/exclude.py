"""Which node of a multi-node job to leave out: a pure decision, table-tested (tests/test_slurm_exclude.py).

A node that stays bad keeps failing every relaunch; inside a Slurm job the cure is to requeue the job
without it (launch.slurm.requeue_excluding). Bad means either
- its GPUs were not clear for at least `bound_s` (the readiness bound: long enough for our own
  leftovers to go and for Slurm's step cleanup; a foreign holder or a stuck driver never clears), or
- `max_fatal` of the last `window` attempts failed with cuda_fatal (a GPU fault, Xid included) on it.
Only nodes of the current allocation count: an excluded node is no longer in it.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.types import CrashClass

WINDOW = 5
MAX_FATAL = 2


@dataclass(frozen=True)
class Exclusion:
    node: str
    reason: str


def node_to_exclude(nodes: tuple[str, ...], bad_for_s: dict[str, float], bound_s: float,
                    recent: list[tuple[str | None, CrashClass | None]],
                    window: int = WINDOW, max_fatal: int = MAX_FATAL) -> Exclusion | None:
    """`bad_for_s`: seconds each node's GPUs have been continuously not clear; `recent`: (node, class) of the
    attempts in order. Returns the node to exclude (the longest bad, then the most faulted), or None."""
    stuck = sorted(((s, n) for n, s in bad_for_s.items() if n in nodes and s >= bound_s), key=lambda x: (-x[0], x[1]))
    if stuck:
        s, n = stuck[0]
        return Exclusion(n, f"GPUs on {n} not clear for {s:.0f} s (bound {bound_s:g} s)")
    faults: dict[str, int] = {}
    for node, cls in recent[-window:]:
        if node in nodes and cls is CrashClass.CUDA_FATAL:
            faults[node] = faults.get(node, 0) + 1
    worst = sorted(((c, n) for n, c in faults.items() if c >= max_fatal), key=lambda x: (-x[0], x[1]))
    if worst:
        c, n = worst[0]
        return Exclusion(n, f"{c} of the last {min(window, len(recent))} attempts failed with cuda_fatal on {n}")
    return None
