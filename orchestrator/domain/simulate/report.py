"""`orchestrator simulate`: the ETT simulation (simulate.py) with saves, waits and starts priced from the
issue-13 inputs, both loops side by side, every input stated next to the result. Pure.

The orchestrator: its recipe's save (storage budget bytes at the write speed), save_steps auto (Daly at
every launch) or fixed, the verified-ready relaunch, a relaunch start-up ratio (1 until measured). The
plain loop: the field's exact procedure: the merged copy at every save, every 100 steps, `sleep 90`,
no hang detection.

checkpoint.async_save (megatron --async_save; ms-swift 4.6 megatron/trainers/base.py save_checkpoint): the
save stops training for the adapter safetensors when they are written (bridge.save_weights, synchronous;
the merged copy too with merge = "every_save") at the write speed, plus each rank's copy of its mcore shard
bytes to host memory (megatron-core's async preload: the shards are staged in CPU memory, then a forked
process writes them) at D2H_BYTES_PER_S. The write of the shards runs in the background (bytes / write
speed): a save is a resume point only once it is done, and the next save waits for it (a floor on the
interval). Not modelled: the save's planning collectives (seconds) and what the background writer takes
from the CPUs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from orchestrator.config.schema import SupervisorSection
from orchestrator.domain.interval import D2H_BYTES_PER_S, DEFAULT_WRITE_BYTES_PER_S, save_seconds
from orchestrator.domain.simulate.model import FIELD, HARSH, HOUR, LOOPS, TRAINING_CLASSES, Scenario, simulate
from orchestrator.domain.simulate.stats import Summary, compare
from orchestrator.types import GIB

MIXES = {"field": FIELD, "harsh": HARSH}

# The storage budget (storage.py) of the shipped recipes/qwen3.5-397b-a17b-lora-ep8.toml (rank 32,
# keep_optimizer, merge = "final", so no HF adapter per save): mcore shards 145.6 GiB (+ 0.5 MiB
# RNG/scheduler) per save, and the merged model, 739.5 GiB, exported once after the last step. The field's
# command writes the adapter safetensors (28.3 GiB) and the merged copy at every save as well.
# tests/test_simulate.py checks these against storage.budget of the shipped recipe.
ADAPTER_BYTES = 30_440_202_240           # adapter_model.safetensors: written synchronously (the field's saves)
ORCH_SAVE_BYTES = 156_297_617_408        # mcore shards and RNG/scheduler state: the background part
MERGED_BYTES = 794_000_000_000
RANKS = 8                                # the shipped recipe's GPUs: each stages its share of the shards
# Device-to-host copy rate per GPU for the async save's staging, 10 GB/s: a conservative figure. An H100/H200
# SXM's host link is PCIe Gen5 x16, 64 GB/s per direction (NVIDIA's H100 datasheet); pinned-memory copies
# reach ~50 GB/s, pageable ones (what a plain `tensor.to("cpu")` gets) ~10-25 GB/s, and eight GPUs copy at
# once through the host's memory. With optimizer_cpu_offload the Adam state is in host memory already (a
# host copy, faster): charged at this rate too.
DEFAULT_READY_S = 5.0          # verified-ready relaunch: issue 13's target, relaunched within 5 s of the exit
DEFAULT_STARTUP_RATIO = 1.0    # no measured start-up speed-up: the documented 8 minutes for every start


@dataclass(frozen=True)
class Inputs:
    """What `orchestrator simulate` prices, stated next to every result."""

    orch_save_bytes: float = ORCH_SAVE_BYTES        # per save, the orchestrator's recipe
    orch_sync_bytes: float = 0.0                    # of which written before training goes on, async or not
    async_save: bool = True                         # the shipped recipe's checkpoint.async_save
    ranks: int = RANKS
    orch_final_bytes: float = MERGED_BYTES          # merge = "final": the one export; 0 otherwise
    plain_save_bytes: float = ADAPTER_BYTES + ORCH_SAVE_BYTES + MERGED_BYTES  # the field's command: all at every save
    write_bytes_per_s: float = float(DEFAULT_WRITE_BYTES_PER_S)  # the plan's default (interval.py)
    save_steps: int | str = "auto"                  # the orchestrator's
    plain_save_steps: int = 100
    plain_wait_s: float = 90.0                      # the field's `sleep 90`
    ready_s: float | None = DEFAULT_READY_S         # None: the orchestrator waits its fixed wait_s
    startup_s: float = 480.0
    startup_ratio: float = DEFAULT_STARTUP_RATIO
    crash_rate_per_h: float | None = None           # None: the mix's own rates
    hang: Literal["adaptive", "fixed"] = "adaptive"  # supervisor.hang: the orchestrator's hang timer
    slowdowns: tuple[tuple[float, float], ...] = ()  # --slowdown SHARE:SPEED (slow_schedule.py)
    on_slowdown: Literal["warn", "restart"] = "warn"  # health.on_slowdown: the orchestrator's answer
    source: str = "shipped qwen3.5-397b-a17b-lora-ep8 recipe"

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["orch_save_s"], d["plain_save_s"] = self.orch_save_s, self.plain_save_s
        d["orch_background_s"] = self.orch_background_s
        d["d2h_bytes_per_s"] = D2H_BYTES_PER_S  # async_save: per GPU, staging the shards in host memory
        d["final_export_s"] = self.orch_final_bytes / self.write_bytes_per_s
        d["slowdowns"] = [list(x) for x in self.slowdowns]
        sc = Scenario()
        d["slow_detect_s"], d["slow_restart_fixes"] = sc.slow_detect_s, sc.slow_restart_fixes
        return d

    @property
    def orch_background_bytes(self) -> float:
        return self.orch_save_bytes - self.orch_sync_bytes if self.async_save else 0.0

    @property
    def orch_save_s(self) -> float:
        """What one save stops training for."""
        return save_seconds(self.orch_save_bytes, self.orch_background_bytes, self.ranks, self.write_bytes_per_s)[0]

    @property
    def orch_background_s(self) -> float:
        """async_save: the shards' write after the save returns (must end before the next save)."""
        return save_seconds(self.orch_save_bytes, self.orch_background_bytes, self.ranks, self.write_bytes_per_s)[1]

    @property
    def plain_save_s(self) -> float:
        return self.plain_save_bytes / self.write_bytes_per_s


def crashes_per_hour(sc: Scenario) -> float:
    """Training crashes per hour of training of a mix."""
    return sum(sc.p_step(c) for c in TRAINING_CLASSES) * HOUR / sc.step_s


def at_crash_rate(sc: Scenario, per_hour: float) -> Scenario:
    """The mix with every class scaled so that training crashes arrive `per_hour` (its proportions kept)."""
    now = crashes_per_hour(sc)
    if per_hour < 0 or now <= 0:
        raise ValueError(f"crash rate must be >= 0 per hour (and the mix must have crashes), got {per_hour}")
    f = per_hour / now
    return replace(sc, per_step={k: v * f for k, v in sc.per_step.items()},
                   per_hour={k: v * f for k, v in sc.per_hour.items()})


def priced(mix: Scenario, i: Inputs = Inputs()) -> Scenario:
    """`mix` with the saves, waits and starts of `i`: the orchestrator's recipe against the field's procedure."""
    sc = at_crash_rate(mix, i.crash_rate_per_h) if i.crash_rate_per_h is not None else mix
    return replace(sc, save_steps=i.save_steps, save_s=i.orch_save_s, save_bg_s=i.orch_background_s, final_export_s=i.orch_final_bytes / i.write_bytes_per_s,
                   plain_save_steps=i.plain_save_steps, plain_save_s=i.plain_save_s, plain_wait_s=i.plain_wait_s,
                   ready_s=i.ready_s, startup_s=i.startup_s, startup_ratio=i.startup_ratio, slowdowns=i.slowdowns,
                   on_slowdown=i.on_slowdown)


def ett_report(mix: Scenario, i: Inputs = Inputs(), seeds: int = 200) -> dict:
    """`orchestrator simulate --json`: both loops over the same seeds, with every input."""
    sc, cfg = priced(mix, i), SupervisorSection(hang=i.hang)
    c = compare(sc, range(seeds), cfg)

    def loop(sm: Summary, results_intervals: list[int] | None) -> dict:
        d = {"ett": round(sm.ratio, 4), "ett_min": round(sm.ratio_min, 4), "ett_max": round(sm.ratio_max, 4),
             "lost": {k: round(v, 4) for k, v in sm.lost_share.items()},
             "crashes_per_run": {k: round(v, 2) for k, v in sm.crashes_per_run.items()},
             "gave_up_per_run": round(sm.gave_up_per_run, 3), "launches_per_run": round(sm.launches_per_run, 1)}
        if results_intervals:
            d["save_interval_steps"] = {"first": results_intervals[0], "min": min(results_intervals),
                                        "max": max(results_intervals)}
        return d

    firsts = [simulate(sc, "orchestrator", s, cfg).intervals for s in range(min(seeds, 20))]
    flat = [k for run in firsts for k in run]
    return {"mix": mix.name, "seeds": seeds, "orchestrator": loop(c["orchestrator"], flat),
            "plain": loop(c["plain"], None),
            "inputs": {**i.as_dict(), "step_s": sc.step_s, "total_steps": sc.total_steps,
                       "crashes_per_hour": round(crashes_per_hour(sc), 4), "mix_rates": {
                           "per_step": sc.per_step, "per_hour": sc.per_hour}}}


def format_report(d: dict) -> str:
    """`orchestrator simulate` as text: both loops' ETT and where the time went, every input stated."""
    i = d["inputs"]
    lines = [f"ETT over {d['seeds']} seeded runs of {i['total_steps']} steps x {i['step_s']:g} s, mix {d['mix']} "
             f"({i['crashes_per_hour']:.3g} training crashes per hour)"]
    for name in LOOPS:
        r = d[name]
        lost = ", ".join(f"{k} {v:.1%}" for k, v in sorted(r["lost"].items(), key=lambda kv: -kv[1]) if v >= 0.0005)
        lines.append(f"  {name:<12} ETT {r['ett']:.3f} [{r['ett_min']:.3f}, {r['ett_max']:.3f}]  lost: {lost}")
        if "save_interval_steps" in r:
            s = r["save_interval_steps"]
            lines.append(f"  {'':<12} save interval {s['first']} steps at the first launch, {s['min']}-{s['max']} later")
    speed = i["write_bytes_per_s"] / GIB
    if i["async_save"]:
        bg = i["orch_save_bytes"] - i["orch_sync_bytes"]
        save = (f"{i['orch_save_bytes'] / GIB:,.1f} GiB per save ({i['source']}), async_save: blocking "
                f"{i['orch_sync_bytes'] / GIB:,.1f} GiB written synchronously at {speed:g} GiB/s + {bg / GIB:,.1f} GiB "
                f"staged to host memory by {i['ranks']} GPUs at {i['d2h_bytes_per_s'] / 1e9:g} GB/s each = "
                f"{i['orch_save_s']:.0f} s, then written in the background at {speed:g} GiB/s = "
                f"{i['orch_background_s']:.0f} s (a resume point once done; the next save waits for it)")
    else:
        save = (f"{i['orch_save_bytes'] / GIB:,.1f} GiB per save ({i['source']}) at {speed:g} GiB/s = "
                f"{i['orch_save_s']:.0f} s, blocking")
    lines += ["inputs:",
              f"  orchestrator: {save}; save_steps {i['save_steps']}; final merged export "
              f"{i['orch_final_bytes'] / GIB:,.1f} GiB = {i['final_export_s']:.0f} s; relaunch "
              + (f"verified ready {i['ready_s']:g} s after the exit (nccl_* at least nccl_settle_s)"
                 if i["ready_s"] is not None else "after the fixed supervisor.wait_s")
              + f"; start-up {i['startup_s']:g} s, relaunches x {i['startup_ratio']:g}",
              f"  plain loop:   {i['plain_save_bytes'] / GIB:,.1f} GiB per save (the field's command: the merged copy "
              f"at every save) at {speed:g} GiB/s = {i['plain_save_s']:.0f} s; every {i['plain_save_steps']} steps; "
              f"`sleep {i['plain_wait_s']:g}`; no hang detection; start-up {i['startup_s']:g} s"]
    if i["slowdowns"]:
        slow = ", ".join(f"{f:.0%} of hours at {v:g}x speed" for f, v in i["slowdowns"])
        answer = ("a graceful stop at the next save and a relaunch (at most one an hour; it clears the slowdown "
                  f"for the rest of the hour with probability {i['slow_restart_fixes']:g})"
                  if i["on_slowdown"] == "restart" else "a warning: it trains on")
        lines.append(f"  slowdowns:    {slow}; plain loop: nothing notices; orchestrator (on_slowdown "
                     f"{i['on_slowdown']}): throughput_drop {i['slow_detect_s']:g} s after the onset, then {answer}")
    return "\n".join(lines)
