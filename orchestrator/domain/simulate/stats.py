"""Sums of simulated runs (simulate.py): each loop's ETT ratio and where its time went over many seeds, and
the closed-form ETT of the simple case that tests check the simulation against. Pure."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from orchestrator.config.schema import SupervisorSection
from orchestrator.domain.simulate.model import KINDS, LOOPS, TRAINING_CLASSES, Result, Scenario, simulate


@dataclass(frozen=True)
class Summary:
    loop: str
    ratio: float                 # sum productive / sum wall over the seeds
    ratio_min: float
    ratio_max: float
    lost_share: dict[str, float]  # kind -> share of wall time
    class_share: dict[str, float]  # cause -> share of wall time
    crashes_per_run: dict[str, float]
    gave_up_per_run: float
    launches_per_run: float
    runs: int


def summarize(results: list[Result]) -> Summary:
    wall = sum(r.wall_s for r in results)
    lost: Counter = Counter()
    by_class: Counter = Counter()
    crashes: Counter = Counter()
    for r in results:
        lost.update(r.lost)
        by_class.update(r.by_class)
        crashes.update(r.crashes)
    n = len(results)
    return Summary(
        loop=results[0].loop, ratio=sum(r.productive_s for r in results) / wall,
        ratio_min=min(r.ratio for r in results), ratio_max=max(r.ratio for r in results),
        lost_share={k: lost[k] / wall for k in KINDS[1:]},
        class_share={k: v / wall for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        crashes_per_run={k: v / n for k, v in sorted(crashes.items())},
        gave_up_per_run=sum(r.gave_up for r in results) / n, launches_per_run=sum(r.launches for r in results) / n,
        runs=n)


def compare(sc: Scenario, seeds: range | list[int] = range(20),
            supervisor: SupervisorSection | None = None) -> dict[str, Summary]:
    """Both loops over the same seeds."""
    return {loop: summarize([simulate(sc, loop, s, supervisor) for s in seeds]) for loop in LOOPS}


def analytic_ratio(sc: Scenario, recovery_s: float, p_step: float | None = None,
                   first_start_s: float | None = None) -> float:
    """Expected ETT for the simple case: one crash class at `p_step` per step (crash at a uniform point of
    the step), no save cost, a fixed `recovery_s` from a crash to the next first step, total_steps a
    multiple of save_steps. Each checkpoint interval is a renewal: it needs k crash-free steps in a row,
    q = (1-p)^k; expected failures (1-q)/q, each losing E[J | J < k] + 1/2 steps plus recovery_s."""
    p = sum(sc.p_step(c) for c in TRAINING_CLASSES) if p_step is None else p_step
    k, dt = int(sc.save_steps), sc.step_s
    first = sc.startup_s if first_start_s is None else first_start_s
    if p <= 0:
        return sc.ideal_s / (sc.ideal_s + first)
    q = (1 - p) ** k
    e_j = sum(j * (1 - p) ** j * p for j in range(k)) / (1 - q)
    per_interval = k * dt + (1 - q) / q * (recovery_s + dt * (e_j + 0.5))
    return sc.ideal_s / (first + sc.total_steps / k * per_interval)
