"""Effective training time (ETT): this orchestrator vs the field's plain restart loop. Pure, seeded.

A discrete-event simulation of one long LoRA run that has to complete `total_steps` steps, under a mix
of crashes, hangs, stale GPU holders and rendezvous-port collisions. Two ways of keeping it alive:

  orchestrator   this package's recovery: the real `orchestrator.domain.policy.decide` (per-class waits:
                 wait_s, + nccl_settle_s for nccl_*, port_in_use relaunched at once on a fresh port,
                 crash-loop backoff, give-up after max_relaunches_without_progress or NaN twice),
                 hang detection after the hang timer (policy.hang_timeout: the attempt's longest step gap,
                 a step plus a save, x 5 within [hang_floor_s, hang_timeout_s] once it has shown 10 gaps and
                 a save; hang_timeout_s before), then SIGTERM, grace_s, SIGKILL; NaN stop,
                 GPU verification before every launch (kill own leftovers, force_wait_s, then
                 exponential backoff; never launch onto busy GPUs) and a fresh rendezvous port per
                 launch. A give-up (exit 3) costs `gave_up_response_s` until a person restarts it.
  plain          the field's `while true; do megatron sft ...; sleep 90; done`: every exit is followed
                 by the same sleep, nothing detects a hang (ms-swift's Megatron default ddp_timeout is
                 208 days: a hang lasts until a person notices, `plain_hang_s`), the port is the same
                 every launch (a port still held by the dead attempt fails the next launch, again and
                 again while it is held), nothing checks the GPUs (a launch while stale holders still
                 hold the memory dies with a cold-start OOM `oom_at_s` into the start, repeatedly,
                 until they die), and a NaN loss trains on until a person notices (`plain_nan_notice_s`).

Both resume from the newest checkpoint (every `save_steps` steps): the steps since it are lost.
Slow hours (`slowdowns`; slow_schedule.py says what each loop does about them) charge the time beyond the
baseline speed to "slow"; the orchestrator with on_slowdown = "restart" stops at the next save and relaunches.

Each second of wall time is charged to one kind (see KINDS), and each lost second also to the crash
class that caused it (`by_class`; the first start is "initial_start", checkpoint writes are
"checkpoint_saves"). ETT ratio = productive / wall, productive = total_steps x step_s.

Model choices (all parameters of `Scenario`):
  * crashes arrive per training step, independently: a per-step probability (`per_step`, e.g. one fla
    OOM per ~500 steps) plus a per-hour rate (`per_hour`) turned into a per-step one; a crash happens
    at a uniformly random point of a step. Crashes during the start-up come only from stale GPU
    holders (cold_start_oom) and port collisions.
  * after a crash, stale GPU holders linger with probability `stale_prob` for an exponential time
    (mean `stale_mean_s`); the orchestrator can kill a fraction `stale_killable` of them (its own
    leftovers, re-parented ranks), the rest it waits out. The dead attempt's rendezvous port stays
    taken with probability `port_held_prob` for an exponential time (mean `port_hold_mean_s`);
    any launch collides with a foreign listener with probability `foreign_port_prob`.
  * a NaN recurs at the same step after a resume from the checkpoint before it with probability
    `nan_repeat_prob` (a bad batch); the person who answers the give-up (or who notices the NaN in the
    plain loop) fixes it.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from orchestrator.domain.interval import Evidence, choose
from orchestrator.domain.policy import History, decide, hang_timeout, next_history
from orchestrator.domain.simulate.slow_schedule import SlowSchedule
from orchestrator.config.schema import SupervisorSection
from orchestrator.types import Action, Crash, CrashClass, Phase

HOUR = 3600.0
LOOPS = ("orchestrator", "plain")
# Every second of wall time goes to exactly one of these.
KINDS = ("productive", "checkpoint", "startup", "lost_progress", "hang", "cleanup", "wait", "gpu_busy",
         "failed_launch", "gave_up", "slow")
# Classes that strike while training (per step / per hour); cold_start_oom and port_in_use arise at launch.
TRAINING_CLASSES = (CrashClass.FLA_BACKWARD_OOM, CrashClass.OOM_DURING_TRAINING, CrashClass.NCCL_ERROR,
                    CrashClass.NCCL_TIMEOUT_HANG, CrashClass.CUDA_FATAL, CrashClass.HOST_OOM_KILLED,
                    CrashClass.NAN_LOSS)


@dataclass(frozen=True)
class Scenario:
    name: str = "scenario"
    step_s: float = 18.0               # one training step
    save_steps: int | str = 100        # a checkpoint every N steps (resume point); orchestrator: or "auto"
    total_steps: int = 20_000          # the run: 100 h of training at 18 s/step
    save_s: float = 0.0                # time one save stops training (charged to "checkpoint")
    save_bg_s: float = 0.0             # orchestrator, async_save: the background write after it; a save is a
                                       # resume point only once it is done, and the next save waits for it
    startup_s: float = 480.0           # launch -> first step (a 400B model's load: 5-10 min)
    # What the two loops do differently about saves, waits and starts (issue 13). None: as above.
    plain_save_steps: int | None = None  # the field's interval (100)
    plain_save_s: float | None = None  # the field's save: the merged copy at every save
    final_export_s: float = 0.0        # orchestrator, merge = "final": the one merged export after the last step
    ready_s: float | None = None       # orchestrator: verified-ready relaunch, seconds after the exit (None: the
                                       # policy's fixed wait_s); nccl_* classes wait at least nccl_settle_s
    startup_ratio: float = 1.0         # orchestrator: a relaunch's start-up / the first one's (page cache, cached
                                       # dataset preprocessing); 1.0 until measured
    oom_at_s: float = 240.0            # launch -> cold-start OOM when stale holders still hold the GPUs
    port_fail_s: float = 30.0          # launch -> EADDRINUSE at the rendezvous
    exit_s: float = 10.0               # crash -> every rank gone (both loops)
    verify_s: float = 2.0              # orchestrator: NVML check + journal before a launch
    stack_dump_s: float = 10.0         # orchestrator: py-spy stacks of a hung trainer
    per_step: dict[str, float] = field(default_factory=dict)   # class -> probability per training step
    per_hour: dict[str, float] = field(default_factory=dict)   # class -> rate per hour of training
    stale_prob: float = 0.0            # after a crash: P(stale GPU holders linger)
    stale_mean_s: float = 300.0
    stale_killable: float = 0.9        # share of stale holders the orchestrator may kill (its own)
    port_held_prob: float = 0.0        # after a crash: P(the dead attempt's port is still taken)
    port_hold_mean_s: float = 300.0
    foreign_port_prob: float = 0.0     # per launch: P(another process listens on the chosen port)
    nan_repeat_prob: float = 0.0       # P(a NaN recurs at the same step after the resume)
    plain_wait_s: float = 90.0         # the loop's `sleep 90`
    plain_hang_s: float = 6 * HOUR     # a hang in the plain loop: until a person notices
    plain_nan_notice_s: float = 6 * HOUR
    gave_up_response_s: float = 2 * HOUR  # orchestrator exit 3 (alerted) -> a person restarts it
    slowdowns: tuple[tuple[float, float], ...] = ()  # (share of hours, speed x the baseline): slow_schedule.py
    on_slowdown: str = "warn"          # orchestrator: health.on_slowdown ("warn" | "restart")
    slow_ratio: float = 1.5            # health.slowdown_ratio: a step this much slower is told from noise
    slow_detect_s: float = 720.0       # onset -> throughput_drop: health.slowdown_window_s + the measuring window
    slow_restart_fixes: float = 0.5    # P(a restart clears the slowdown for the rest of its hour)

    def p_step(self, cls: CrashClass) -> float:
        return self.per_step.get(cls.value, 0.0) + self.per_hour.get(cls.value, 0.0) * self.step_s / HOUR

    @property
    def ideal_s(self) -> float:
        return self.total_steps * self.step_s


@dataclass
class Result:
    loop: str
    seed: int
    wall_s: float = 0.0
    productive_s: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS[1:], 0.0))
    by_class: dict[str, float] = field(default_factory=dict)
    crashes: Counter = field(default_factory=Counter)
    launches: int = 0
    slow_restarts: int = 0
    gave_up: int = 0
    completed: bool = False
    intervals: list[int] = field(default_factory=list)  # the save interval of each launch that trained

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


class _Clock:
    """Advances wall time, charging each span to a kind and (if lost) to the class that caused it."""

    def __init__(self, result: Result):
        self.r, self.t, self.cause = result, 0.0, "initial_start"

    def charge(self, kind: str, seconds: float, cause: str | None = None) -> None:
        if seconds <= 0:
            return
        self.t += seconds
        if kind == "productive":
            self.r.productive_s += seconds
            return
        self.r.lost[kind] += seconds
        c = cause or self.cause
        self.r.by_class[c] = self.r.by_class.get(c, 0.0) + seconds


def _expo(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def _draw_crash(rng: random.Random, probs: list[tuple[CrashClass, float]], total: float) -> tuple[float, CrashClass]:
    """Steps completed before the next crash (geometric; inf if none) and its class."""
    if total <= 0:
        return math.inf, CrashClass.OTHER
    u = 1.0 - rng.random()  # (0, 1]
    k = math.floor(math.log(u) / math.log1p(-total)) if total < 1 else 0
    x, acc = rng.random() * total, 0.0
    for cls, p in probs:
        acc += p
        if x < acc:
            return k, cls
    return k, probs[-1][0]


def simulate(sc: Scenario, loop: str, seed: int = 0, supervisor: SupervisorSection | None = None,
             max_wall_factor: float = 50.0) -> Result:
    """One run of `sc` kept alive by `loop` ("orchestrator" or "plain"), until total_steps are done
    (or max_wall_factor x the ideal time has passed: then `completed` is False)."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    cfg = supervisor or SupervisorSection()
    orch = loop == "orchestrator"
    rng = random.Random(seed)
    res = Result(loop, seed)
    clk = _Clock(res)
    probs = [(c, sc.p_step(c)) for c in TRAINING_CLASSES if sc.p_step(c) > 0]
    p_total = sum(p for _, p in probs)
    if p_total >= 1:
        raise ValueError(f"crash probability per step {p_total:.3g} >= 1")
    dt = sc.step_s
    fixed = sc.save_steps if orch else (sc.plain_save_steps or sc.save_steps)
    if fixed == "auto" and not orch:
        raise ValueError('save_steps = "auto" is the orchestrator\'s; the plain loop saves every plain_save_steps')
    save_s = sc.save_s if orch or sc.plain_save_s is None else sc.plain_save_s
    bg_s = sc.save_bg_s if orch else 0.0

    def save_cost(k: int) -> float:
        """What one save stops training for: its blocking part, plus, when the interval is shorter than the
        background write, waiting for the previous one (ms-swift overlaps at most that)."""
        return save_s + max(0.0, bg_s - k * dt)
    failures, exposed_s = 0, 0.0  # what the orchestrator has seen so far: training crashes, training time
    started = False               # a start-up after the first is a relaunch (startup_ratio)
    ckpt = 0                      # steps kept (the newest checkpoint)
    stale_until = 0.0             # stale GPU holders hold the memory until then
    port_until = 0.0              # plain: the fixed rendezvous port is taken until then
    history = History()
    nan_at: int | None = None     # a NaN that recurs at this step after a resume
    saved_since_launch = False
    max_wall = max_wall_factor * sc.ideal_s
    slow, last_restart = SlowSchedule(sc.slowdowns, seed), -math.inf

    def interval_now() -> int:
        if fixed != "auto":
            return int(fixed)
        ev = Evidence(save_s, "scenario", dt, "scenario", failures, exposed_s / HOUR, "this run", bg_s)
        return choose(ev).steps

    def after_crash(cls: CrashClass, progress: bool) -> None:
        """Leftovers of the dead attempt, then the loop's decision and its waits."""
        nonlocal stale_until, port_until, history, nan_at
        res.crashes[cls.value] += 1
        if cls is not CrashClass.PORT_IN_USE:
            if rng.random() < sc.stale_prob:
                stale_until = max(stale_until, clk.t + _expo(rng, sc.stale_mean_s))
            if rng.random() < sc.port_held_prob:
                port_until = max(port_until, clk.t + _expo(rng, sc.port_hold_mean_s))
        if not orch:
            clk.charge("wait", sc.plain_wait_s)
            return
        crash = Crash(cls, phase=Phase.STARTUP if cls is CrashClass.COLD_START_OOM else Phase.TRAINING)
        d = decide(crash, history, cfg, clk.t, progress)
        history = next_history(history, crash, clk.t, progress)
        if d.action is Action.GIVE_UP:
            res.gave_up += 1
            clk.charge("gave_up", sc.gave_up_response_s)
            history, nan_at = History(), None  # a person looked, fixed the cause and restarted it
        else:
            wait = d.wait_s
            if sc.ready_s is not None:  # relaunched once verified ready; the policy's wait_s is the upper bound
                settle = cfg.nccl_settle_s if cls.value.startswith("nccl") else 0.0
                wait = min(wait, max(sc.ready_s, settle))
            clk.charge("wait", wait + d.backoff_s)

    while ckpt < sc.total_steps and clk.t < max_wall:
        # --- before the launch: the orchestrator verifies the GPUs (never launches onto busy ones)
        if orch:
            clk.charge("cleanup", sc.verify_s)
            backoff = 0.0
            while clk.t < stale_until:
                if rng.random() < sc.stale_killable:  # own leftovers: killed, memory freed
                    stale_until = clk.t
                clk.charge("gpu_busy", cfg.force_wait_s)
                if clk.t >= stale_until:
                    break
                backoff = min(cfg.backoff_max_s, max(backoff * 2, cfg.force_wait_s, 1.0))
                clk.charge("gpu_busy", backoff)
        res.launches += 1
        saved_since_launch = False
        # --- rendezvous port
        foreign = rng.random() < sc.foreign_port_prob
        if foreign or (not orch and clk.t < port_until):
            if foreign and not orch:  # the loop keeps its port: the foreign listener fails it again
                port_until = max(port_until, clk.t + _expo(rng, sc.port_hold_mean_s))
            clk.cause = CrashClass.PORT_IN_USE.value
            clk.charge("failed_launch", sc.port_fail_s)
            after_crash(CrashClass.PORT_IN_USE, False)
            continue
        # --- model load: stale holders still on the GPUs when the weights arrive -> cold-start OOM
        if clk.t + sc.oom_at_s < stale_until:
            clk.cause = CrashClass.COLD_START_OOM.value
            clk.charge("failed_launch", sc.oom_at_s)
            clk.charge("cleanup", sc.exit_s)
            after_crash(CrashClass.COLD_START_OOM, False)
            continue
        clk.charge("startup", sc.startup_s * (sc.startup_ratio if started and orch else 1.0))
        started = True
        k = interval_now()
        res.intervals.append(k)
        # --- training from ckpt: the next crash
        left = sc.total_steps - ckpt
        steps, cls = _draw_crash(rng, probs, p_total)
        if nan_at is not None and nan_at - ckpt < min(steps, left):
            steps, cls = nan_at - ckpt, CrashClass.NAN_LOSS
        nan_at = None
        t0 = clk.t
        stop = slow.restart_step(t0, ckpt, min(steps, left), dt, k, sc.slow_ratio, sc.slow_detect_s,
                                 last_restart + HOUR) if orch and sc.on_slowdown == "restart" else None
        if stop is not None:  # throughput_drop: a graceful stop at the next save, then a relaunch
            clk.cause = "slowdown_restart"
            clk.charge("productive", (stop - ckpt) * dt)
            clk.charge("slow", slow.wall(t0, stop - ckpt, dt) - (stop - ckpt) * dt, "slowdown")
            clk.charge("checkpoint", (stop // k - ckpt // k) * save_cost(k), "checkpoint_saves")
            clk.charge("cleanup", sc.exit_s)
            if slow.rng.random() < sc.slow_restart_fixes:
                slow.clear(clk.t)
            last_restart, ckpt = clk.t, stop
            res.slow_restarts += 1
            continue
        if steps >= left:  # completes
            saves = (sc.total_steps - 1) // k - ckpt // k  # the last step needs no resume point
            clk.charge("productive", left * dt)
            clk.charge("slow", slow.wall(t0, left, dt) - left * dt, "slowdown")
            clk.charge("checkpoint", saves * save_cost(k) + (sc.final_export_s if orch else 0.0), "checkpoint_saves")
            ckpt = sc.total_steps
            res.completed = True
            break
        steps = int(steps)
        failures += 1                             # a training crash: interval.run_failures counts it
        crash_step = ckpt + steps                 # steps completed before the failing one
        saved = crash_step // k * k               # the newest save started (at absolute multiples of k, as
        saves = saved // k - ckpt // k           # ms-swift does: after a resume from 87 at k = 60, at 120)
        new_ckpt = max(ckpt, saved)
        if saves and (crash_step - saved) * dt < bg_s:  # its background write was still running: lost with it
            new_ckpt = max(ckpt, saved - k)
        clk.cause = cls.value
        exposed_s += (crash_step - ckpt) * dt + saves * save_cost(k)
        clk.charge("productive", (new_ckpt - ckpt) * dt)
        clk.charge("checkpoint", saves * save_cost(k), "checkpoint_saves")
        frac = rng.random()
        clk.charge("lost_progress", (crash_step - new_ckpt + frac) * dt)
        trained = crash_step - ckpt + frac
        clk.charge("slow", slow.wall(t0, trained, dt) - trained * dt, "slowdown")
        saved_since_launch = new_ckpt > ckpt
        if cls is CrashClass.NCCL_TIMEOUT_HANG:
            if orch:  # no new step within the hang timer (policy.hang_timeout); stacks; SIGTERM, grace_s, SIGKILL
                clk.charge("hang", hang_timeout(cfg, dt + save_cost(k), steps - 1, saves)[0])
                clk.charge("cleanup", sc.stack_dump_s + cfg.grace_s + sc.exit_s)
            else:     # until a person notices and kills it
                clk.charge("hang", sc.plain_hang_s)
                clk.charge("cleanup", sc.exit_s)
        elif cls is CrashClass.NAN_LOSS:
            if orch:  # the supervisor stops the attempt at the NaN step; resume from the checkpoint before it
                clk.charge("cleanup", cfg.grace_s + sc.exit_s)
                if rng.random() < sc.nan_repeat_prob:
                    nan_at = crash_step
            else:     # trains on with NaN weights (poisoned checkpoints) until a person rolls it back
                clk.charge("lost_progress", sc.plain_nan_notice_s)
                clk.charge("cleanup", sc.exit_s)
        else:
            clk.charge("cleanup", sc.exit_s)
        ckpt = new_ckpt
        after_crash(cls, saved_since_launch)
    res.wall_s = clk.t
    return res


# --- the two mixes of the reliability report -------------------------------------------------------

# The field's numbers: 18 s steps, a checkpoint every 100 steps, `sleep 90`, one fla OOM spike per ~500
# steps, and small rates of the rest: an NCCL error every ~2 days, a hang every ~3 days, a CUDA fatal
# error every ~5 days; after a crash, the old port is still taken 10 % of the time and stale holders
# keep the GPUs 5 % of the time (~5 min).
FIELD = Scenario(
    name="field", per_step={"fla_backward_oom": 1 / 500},
    per_hour={"nccl_error": 1 / 48, "nccl_timeout_hang": 1 / 72, "cuda_fatal": 1 / 120},
    stale_prob=0.05, stale_mean_s=300, port_held_prob=0.10, port_hold_mean_s=300)

# A harsher node: flaky fabric (an NCCL error every ~10 h, a hang every ~12 h), a host OOM kill and a
# NaN spike every ~4 days (30 % of them recur from the checkpoint), stale holders after 30 % of crashes
# for ~15 min (a fifth of them not the orchestrator's to kill), the old port held after 25 % of
# crashes, and 1 % of launches colliding with a foreign listener.
HARSH = Scenario(
    name="harsh", per_step={"fla_backward_oom": 1 / 500},
    per_hour={"nccl_error": 1 / 10, "nccl_timeout_hang": 1 / 12, "cuda_fatal": 1 / 48,
              "host_oom_killed": 1 / 96, "nan_loss": 1 / 96},
    stale_prob=0.30, stale_mean_s=900, stale_killable=0.8, port_held_prob=0.25, port_hold_mean_s=600,
    foreign_port_prob=0.01, nan_repeat_prob=0.3)
