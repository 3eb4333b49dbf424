"""`checkpoint.save_steps = "auto"`: the checkpoint interval that maximises expected goodput. Pure.

Young/Daly: with a save costing C seconds and failures arriving every M seconds on average, saving every
T = sqrt(2 C M) seconds minimises the expected loss per unit of time, C/T (writing checkpoints) +
T/(2M) (redoing, after each failure, half an interval on average), to first order (Young); Daly's
higher-order form, used here, also counts the save as exposed to failures (a little shorter). The
chooser turns T into steps with the step time and clamps it (`Bounds`).

Evidence, and the documented prior it starts from:
  C  the mean measured save seconds of this run (costs.py, journal attempts.save_s); before any, the
     storage budget's bytes per save / the write speed (probed, else DEFAULT_WRITE_BYTES_PER_S).
  M  (PRIOR_FAILURES + failures) / (PRIOR_HOURS + hours): crashes and running hours of this run (the
     journal) plus earlier runs on this node (node_history.py). The prior is the field's rate (one crash
     per ~2.25 h: an fla OOM every ~500 steps of 18 s plus rarer NCCL/CUDA faults) weighed as 4.5 h of
     running: after a day of evidence, the evidence dominates.
  step time  this run's measured seconds per step; before any, the storage budget's (recipe
     checkpoint.step_time_s or the per-model default).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from orchestrator.domain.costs import mean_save
from orchestrator.types import Attempt, CrashClass

HOUR = 3600.0
DEFAULT_WRITE_BYTES_PER_S = 1 << 30  # 1 GiB/s: one local NVMe through a filesystem with fsync; `plan` probes the real one
# --async_save: each GPU stages its share of the mcore shards in host memory before training goes on. Conservative:
# PCIe Gen5 x16 is 64 GB/s per direction (H100 datasheet), pinned copies reach ~50 GB/s; not measured here (no GPU).
D2H_BYTES_PER_S = 10e9
PRIOR_FAILURES = 2.0                  # prior: 2 failures in 4.5 h of running (the field's ~0.44 per hour)
PRIOR_HOURS = 4.5
# Exits that say nothing about the node's failure rate: a stop, a port taken at launch, a full disk.
NOT_FAILURES = frozenset({CrashClass.PORT_IN_USE, CrashClass.DISK_FULL})


@dataclass(frozen=True)
class Bounds:
    min_steps: int = 10                 # below this the trainer mostly saves
    max_interval_s: float = 4 * HOUR    # a failure (or a hang noticed late) never costs more than this
    max_save_share: float = 0.5         # never spend more than half the time writing: T >= C (1-s)/s


@dataclass(frozen=True)
class Evidence:
    save_s: float
    save_source: str          # "measured (N saves)" or "prior: X GiB at Y MiB/s"
    step_s: float
    step_source: str
    failures: float           # this run + node history, without the prior
    hours: float
    failure_source: str
    # --async_save: the background write of the mcore shards (bytes / write speed), which must finish
    # before the next save starts; save_s is then only the blocking part. 0: saves are synchronous.
    background_s: float = 0.0

    @property
    def mtbf_s(self) -> float:
        return (PRIOR_HOURS + self.hours) / (PRIOR_FAILURES + self.failures) * HOUR


@dataclass(frozen=True)
class Choice:
    steps: int
    interval_s: float
    young_s: float            # sqrt(2 C M), before clamping
    clamped: str              # "" or why the bound applied
    expected_goodput: float   # 1 - C/T - T/(2M) at the chosen T (first order; restarts not counted)
    evidence: Evidence

    @property
    def reason(self) -> str:
        e = self.evidence
        why = (f"every {self.steps} steps (~{self.interval_s / 60:.0f} min): Young/Daly for save {e.save_s:.0f} s"
               f" and MTBF {e.mtbf_s / HOUR:.2f} h (sqrt(2CM) = {self.young_s / 60:.0f} min) at {e.step_s:g} s/step")
        if e.background_s:
            why += f" (async_save: {e.background_s:.0f} s of background write per save)"
        if self.clamped:
            why += f", {self.clamped}"
        return (f"{why}; save cost {e.save_source}; step time {e.step_source}; failures {e.failure_source}; "
                f"expected goodput from saves and lost steps {self.expected_goodput:.3f}")

    def as_dict(self) -> dict:
        return {"steps": self.steps, "interval_s": round(self.interval_s, 1), "young_s": round(self.young_s, 1),
                "clamped": self.clamped, "expected_goodput": round(self.expected_goodput, 4),
                "mtbf_s": round(self.evidence.mtbf_s, 1), **asdict(self.evidence), "reason": self.reason}


def expected_goodput(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """First-order share of time kept: saves cost C per T, a failure loses T/2 on average."""
    return max(0.0, 1.0 - save_s / interval_s - interval_s / (2 * mtbf_s)) if interval_s > 0 else 0.0


def daly(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum (2006): Young's sqrt(2CM) corrected for the save itself
    being exposed to failures; for C >= 2M, M (save as often as failures come)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def choose(e: Evidence, bounds: Bounds = Bounds()) -> Choice:
    """Young/Daly's interval in steps, clamped to `bounds`."""
    young = math.sqrt(2 * e.save_s * e.mtbf_s)
    steps = max(1, round(daly(e.save_s, e.mtbf_s) / e.step_s))
    clamped = ""
    floor_s = max(e.save_s * (1 - bounds.max_save_share) / bounds.max_save_share, e.background_s)
    lo = max(bounds.min_steps, math.ceil(floor_s / e.step_s))
    hi = max(lo, math.floor(bounds.max_interval_s / e.step_s))
    if steps < lo:
        steps, clamped = lo, (f"raised to {lo} (at least {bounds.min_steps} steps, at most "
                              f"{bounds.max_save_share:.0%} of the time saving"
                              + (f", the background write of {e.background_s:.0f} s done before the next save"
                                 if e.background_s else "") + ")")
    elif steps > hi:
        steps, clamped = hi, f"lowered to {hi} (at most {bounds.max_interval_s / HOUR:g} h between saves)"
    t = steps * e.step_s
    return Choice(steps, t, young, clamped, expected_goodput(t, e.save_s, e.mtbf_s), e)


def run_failures(attempts: list[Attempt], now: float) -> tuple[int, float]:
    """(failures, hours) of training exposed to them, over a run's attempts. Only what the interval bears on
    counts: failures of attempts that trained (a crash before the first step loses no steps, whatever the
    interval) with a class that says something about the node (not a stop, a taken port, a full disk);
    hours from the first step to the exit (to now for the running attempt)."""
    failures = sum(1 for a in attempts if a.first_step_at is not None and a.cls is not None
                   and a.cls not in NOT_FAILURES)
    hours = sum(max(0.0, (a.ended_at if a.ended_at is not None else now) - a.first_step_at)
                for a in attempts if a.first_step_at is not None) / HOUR
    return failures, hours


def measured_step_s(attempts: list[Attempt]) -> float | None:
    """Seconds per step over the attempts' first to last step records (saves included: they are part of the
    step time the budget and the chooser see only when measured that way; a small overestimate)."""
    steps = secs = 0.0
    for a in attempts:
        if a.first_step_at and a.last_step_at and a.end_step is not None and a.last_step_at > a.first_step_at:
            first = (a.start_step or 0) + 1
            if a.end_step > first:
                steps += a.end_step - first
                secs += a.last_step_at - a.first_step_at - (a.save_s or 0.0) * (a.save_count or 0)
    return secs / steps if steps > 0 and secs > 0 else None


def save_seconds(save_bytes: float, background_bytes: float, ranks: int, write_bytes_per_s: float
                 ) -> tuple[float, float]:
    """(seconds a save stops training for, seconds of background write after it returns). `background_bytes`:
    what --async_save writes after the save returns (the mcore shards; 0 when saves are synchronous), staged
    in host memory first by `ranks` GPUs at D2H_BYTES_PER_S each."""
    blocking = (save_bytes - background_bytes) / write_bytes_per_s + background_bytes / max(ranks, 1) / D2H_BYTES_PER_S
    return blocking, background_bytes / write_bytes_per_s


def evidence(attempts: list[Attempt], node: tuple[float, float], save_bytes: float, write_bytes_per_s: float | None,
             budget_step_s: float, step_source: str, now: float, background_bytes: float = 0.0,
             ranks: int = 1) -> Evidence:
    """The chooser's inputs for a run: its journal's attempts, the node's other runs (failures, hours), the
    storage budget's bytes per save (of which `background_bytes` written by --async_save after the save
    returns, by `ranks` GPUs), a probed write speed (None: the default) and the budget's step time. A measured
    save is what training stopped for: the background write stays the budget's."""
    speed = write_bytes_per_s or DEFAULT_WRITE_BYTES_PER_S
    prior, background = save_seconds(save_bytes, background_bytes, ranks, speed)
    save, n = mean_save((a.save_s, a.save_count) for a in attempts)
    if save is not None:
        save_source = f"measured ({n} save{'s' if n != 1 else ''} of this run)"
    else:
        save = prior
        save_source = (f"prior: {save_bytes / 2**30:,.1f} GiB per save (storage budget) at {speed / 2**20:,.0f} MiB/s"
                       + ("" if write_bytes_per_s else " (default write speed)")
                       + (f", {background_bytes / 2**30:,.1f} GiB of it written in the background (async_save)"
                          if background_bytes else ""))
    step = measured_step_s(attempts)
    step_s, step_src = (step, "measured") if step else (budget_step_s, f"prior: {step_source}")
    f_run, h_run = run_failures(attempts, now)
    f_node, h_node = node
    src = (f"{f_run} in {h_run:.1f} h of this run, {f_node:g} in {h_node:.1f} h of earlier runs on this node, "
           f"prior {PRIOR_FAILURES:g} in {PRIOR_HOURS:g} h")
    return Evidence(save, save_source, step_s, step_src, f_run + f_node, h_run + h_node, src, background)


def starting_choice(save_bytes: float, step_s: float, step_source: str = "storage budget",
                    write_bytes_per_s: float | None = None, background_bytes: float = 0.0, ranks: int = 1) -> Choice:
    """The interval a run with no evidence yet starts with (`plan`, and the storage budget's save interval)."""
    return choose(evidence([], (0.0, 0.0), save_bytes, write_bytes_per_s, step_s, step_source, 0.0,
                           background_bytes, ranks))
