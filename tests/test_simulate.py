"""The effective-training-time simulation (orchestrator/domain/simulate/model.py): sanity, policy, determinism, analytics."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.loop import preflight
from orchestrator.domain.simulate import report as R
from orchestrator.domain.simulate import slow_schedule as SS
from orchestrator.config.recipe import SupervisorSection
from orchestrator.domain.simulate.model import FIELD, HARSH, KINDS, LOOPS, Scenario, simulate
from orchestrator.domain.simulate.stats import analytic_ratio, compare, summarize

# No crash-loop backoff, no give-up: the policy reduces to its per-class waits.
NO_GUARDS = SupervisorSection(max_crashes_per_hour=10**6, max_relaunches_without_progress=10**6)
FLA = Scenario(per_step={"fla_backward_oom": 1 / 500})


def ratio(sc: Scenario, loop: str, seeds=range(50), cfg: SupervisorSection | None = None) -> float:
    return summarize([simulate(sc, loop, s, cfg) for s in seeds]).ratio


# --- accounting ----------------------------------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sc", [Scenario(), FLA, FIELD, HARSH, replace(HARSH, save_s=30.0)], ids=lambda s: s.name)
def test_every_second_is_charged_once(sc, loop):
    for seed in range(5):
        r = simulate(sc, loop, seed)
        assert r.completed
        assert r.productive_s == pytest.approx(sc.ideal_s)
        assert r.productive_s + sum(r.lost.values()) == pytest.approx(r.wall_s)
        assert sum(r.by_class.values()) == pytest.approx(sum(r.lost.values()))
        assert set(r.lost) == set(KINDS[1:])
        assert 0 < r.ratio <= 1


@pytest.mark.parametrize("loop,extra", [("plain", 0.0), ("orchestrator", Scenario().verify_s)])
@pytest.mark.parametrize("startup_s", [60.0, 480.0, 900.0])
def test_no_crashes_ratio_is_one_minus_startup(loop, extra, startup_s):
    sc = Scenario(startup_s=startup_s)
    r = simulate(sc, loop, seed=1)
    assert r.ratio == pytest.approx(sc.ideal_s / (sc.ideal_s + startup_s + extra), rel=1e-12)
    assert r.launches == 1 and not r.crashes
    assert r.lost["startup"] == startup_s and r.lost["lost_progress"] == 0


def test_deterministic_with_a_seed():
    for loop in LOOPS:
        a, b = simulate(HARSH, loop, seed=7), simulate(HARSH, loop, seed=7)
        assert a == b
        assert simulate(HARSH, loop, seed=8) != a


# --- what the model must show -------------------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_more_frequent_saves_reduce_lost_progress(loop):
    lost = []
    for k in (1000, 500, 200, 100, 50, 20):
        sm = summarize([simulate(replace(FLA, save_steps=k), loop, s, NO_GUARDS) for s in range(40)])
        lost.append(sm.lost_share["lost_progress"])
    assert lost == sorted(lost, reverse=True), lost
    assert lost[0] > 5 * lost[-1]


def test_save_cost_makes_very_frequent_saves_worse():
    """With a save cost there is an optimum (Young/Daly): saving every step is worse than every 100."""
    sc = replace(FLA, save_s=30.0)
    assert ratio(replace(sc, save_steps=100), "plain") > ratio(replace(sc, save_steps=2), "plain")


@pytest.mark.parametrize("hangs_per_day,plain_hang_h,margin", [
    (1, 6, 0.10), (2, 6, 0.20), (2, 24, 0.40), (4, 6, 0.30),
])
def test_hang_detection_matters(hangs_per_day, plain_hang_h, margin):
    sc = Scenario(per_hour={"nccl_timeout_hang": hangs_per_day / 24}, plain_hang_s=plain_hang_h * 3600.0)
    orch, plain = ratio(sc, "orchestrator"), ratio(sc, "plain")
    assert orch - plain > margin, (orch, plain)


@pytest.mark.parametrize("hang, save_steps, per_hang", [
    ("fixed", 100, 1800.0),      # hang_timeout_s
    ("adaptive", 100, None),     # hang_floor_s once an attempt lived through a save, hang_timeout_s before
    ("adaptive", 10**6, 1800.0),  # never a save: hang_timeout_s
])
def test_hang_cost_is_the_detection_timeout(hang, save_steps, per_hang):
    sc = Scenario(per_hour={"nccl_timeout_hang": 1 / 12}, save_steps=save_steps)
    cfg = NO_GUARDS.model_copy(update={"hang": hang})
    r = simulate(sc, "orchestrator", seed=3, supervisor=cfg)
    n = r.crashes["nccl_timeout_hang"]
    if per_hang is not None:
        assert r.lost["hang"] == pytest.approx(per_hang * n)
    else:  # 5 x (18 s step + 0 s save) < the 300 s floor: each hang costs 300 s or 1800 s, most of them 300
        assert 300 * n < r.lost["hang"] < 1800 * n and (r.lost["hang"] - 300 * n) % 1500 == pytest.approx(0, abs=1e-6)
    plain = simulate(sc, "plain", seed=3, supervisor=cfg)
    assert plain.lost["hang"] == pytest.approx(sc.plain_hang_s * plain.crashes["nccl_timeout_hang"])


@pytest.mark.parametrize("cls,orch_wait", [
    ("fla_backward_oom", 90.0), ("cuda_fatal", 90.0), ("host_oom_killed", 90.0),
    ("nccl_error", 120.0), ("nccl_timeout_hang", 120.0),  # wait_s + nccl_settle_s
])
def test_waits_follow_the_policy(cls, orch_wait):
    sc = Scenario(per_hour={cls: 0.5})
    for loop, per_crash in [("orchestrator", orch_wait), ("plain", 90.0)]:
        r = simulate(sc, loop, seed=5, supervisor=NO_GUARDS)
        assert r.crashes[cls] > 10
        assert r.lost["wait"] == pytest.approx(per_crash * sum(r.crashes.values()))


def test_crash_loop_backs_off():
    """More than max_crashes_per_hour: the real policy adds exponential backoff to wait_s + nccl_settle_s."""
    sc = Scenario(per_hour={"nccl_error": 30.0}, save_steps=5, total_steps=2000)
    cfg = SupervisorSection(max_relaunches_without_progress=10**6)
    r = simulate(sc, "orchestrator", seed=0, supervisor=cfg)
    assert r.completed and r.gave_up == 0
    assert r.lost["wait"] > 120.0 * sum(r.crashes.values()) + 600


def test_no_checkpoint_progress_gives_up():
    """Crashes faster than the checkpoint interval: every max_relaunches_without_progress-th crash is a give-up
    (exit 3), which costs gave_up_response_s until a person restarts the supervisor."""
    sc = Scenario(per_hour={"nccl_error": 6.0}, save_steps=500, total_steps=2000, gave_up_response_s=600.0)
    r = simulate(sc, "orchestrator", seed=0, max_wall_factor=20)
    assert not r.completed
    assert r.gave_up == sum(r.crashes.values()) // SupervisorSection().max_relaunches_without_progress
    assert r.lost["gave_up"] == pytest.approx(600.0 * r.gave_up)


def test_port_held_after_a_crash_costs_the_plain_loop_only():
    sc = replace(FLA, port_held_prob=1.0, port_hold_mean_s=600.0)
    plain, orch = simulate(sc, "plain", seed=2), simulate(sc, "orchestrator", seed=2)
    assert plain.crashes["port_in_use"] > plain.crashes["fla_backward_oom"]  # repeated restart cycles
    assert plain.lost["failed_launch"] > 0
    assert orch.crashes["port_in_use"] == 0  # a fresh port per launch


def test_foreign_port_collision_is_a_free_immediate_retry():
    sc = Scenario(foreign_port_prob=0.5, total_steps=2000)
    r = simulate(sc, "orchestrator", seed=4)
    assert r.crashes["port_in_use"] > 0 and r.gave_up == 0
    assert r.lost["wait"] == 0  # relaunched at once, no wait_s
    assert r.lost["failed_launch"] == pytest.approx(sc.port_fail_s * r.crashes["port_in_use"])


def test_stale_holders_repeat_cold_start_ooms_only_without_gpu_verification():
    sc = replace(FLA, stale_prob=1.0, stale_mean_s=900.0, stale_killable=0.5)
    plain, orch = summarize([simulate(sc, "plain", s) for s in range(20)]), \
        summarize([simulate(sc, "orchestrator", s) for s in range(20)])
    assert plain.crashes_per_run["cold_start_oom"] > plain.crashes_per_run["fla_backward_oom"]
    assert "cold_start_oom" not in orch.crashes_per_run
    assert orch.lost_share["gpu_busy"] > 0 and orch.lost_share["failed_launch"] == 0
    assert orch.ratio > plain.ratio


def test_nan_stop_beats_training_on_nan():
    sc = Scenario(per_hour={"nan_loss": 1 / 24})
    assert ratio(sc, "orchestrator") - ratio(sc, "plain") > 0.1


def test_nan_twice_in_a_row_gives_up():
    sc = Scenario(per_hour={"nan_loss": 1 / 24}, nan_repeat_prob=1.0)
    r = simulate(sc, "orchestrator", seed=1, supervisor=NO_GUARDS)
    assert r.gave_up > 0 and r.crashes["nan_loss"] == 2 * r.gave_up


@pytest.mark.parametrize("sc", [FIELD, HARSH], ids=lambda s: s.name)
def test_the_orchestrator_beats_the_plain_loop_on_both_mixes(sc):
    c = compare(sc, range(30))
    assert c["orchestrator"].ratio > c["plain"].ratio
    assert c["orchestrator"].lost_share["hang"] < c["plain"].lost_share["hang"]


def test_harsh_is_harsher():
    for loop in LOOPS:
        assert ratio(HARSH, loop) < ratio(FIELD, loop)


# --- the analytic expectation -------------------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("p,k", [(1 / 500, 100), (1 / 200, 50), (1 / 1000, 300), (1 / 100, 20)])
def test_simulation_matches_the_analytic_expectation(loop, p, k):
    sc = Scenario(per_step={"fla_backward_oom": p}, save_steps=k, total_steps=12_000)
    wait = sc.plain_wait_s if loop == "plain" else NO_GUARDS.wait_s + sc.verify_s
    first = sc.startup_s + (sc.verify_s if loop == "orchestrator" else 0.0)
    expected = analytic_ratio(sc, recovery_s=sc.exit_s + wait + sc.startup_s, first_start_s=first)
    got = ratio(sc, loop, range(200), NO_GUARDS)
    assert got == pytest.approx(expected, rel=0.01), (got, expected)


def test_analytic_ratio_limits():
    sc = Scenario()
    assert analytic_ratio(sc, 600.0) == pytest.approx(sc.ideal_s / (sc.ideal_s + sc.startup_s))
    sc = Scenario(per_step={"fla_backward_oom": 1 / 500})
    slow, fast = analytic_ratio(sc, 3600.0), analytic_ratio(sc, 60.0)
    assert 0 < slow < fast < 1


# --- input checks -------------------------------------------------------------------------------

def test_bad_inputs():
    with pytest.raises(ValueError, match="loop"):
        simulate(Scenario(), "systemd")
    with pytest.raises(ValueError, match="per step"):
        simulate(Scenario(per_step={"fla_backward_oom": 1.0}), "plain")


def test_an_impossible_run_ends_at_the_wall_cap():
    sc = Scenario(per_step={"fla_backward_oom": 0.2}, save_steps=1000, total_steps=2000)
    r = simulate(sc, "plain", seed=0, max_wall_factor=3)
    assert not r.completed and r.wall_s >= 3 * sc.ideal_s and r.productive_s == 0 and r.ratio == 0
    assert math.isfinite(r.wall_s)


# --- issue 13: saves, waits and starts priced (domain/simulate/report.py); `orchestrator simulate` ----------

def test_default_save_bytes_are_the_shipped_397b_recipes_storage_budget():
    from recipes import RECIPES
    from orchestrator.domain import storage
    from orchestrator.config.recipe import load
    r = load(next(p for p in RECIPES if p.name.startswith("qwen3.5-397b")))
    cfg, total = preflight.model_config(r)
    b = storage.budget(r, cfg, total)
    assert r.checkpoint.merge == "final"
    assert sum(b.per_save_bytes.values()) == R.ORCH_SAVE_BYTES and b.final_merged_bytes == R.MERGED_BYTES
    assert "adapter" not in b.per_save_bytes and r.parallel.nproc_per_node == R.RANKS
    with_adapter = storage.budget(load(next(p for p in RECIPES if p.name.startswith("qwen3.5-397b")),
                                         ["checkpoint.save_safetensors=true"]), cfg, total)
    assert with_adapter.per_save_bytes["adapter"] == R.ADAPTER_BYTES
    assert R.Inputs().plain_save_bytes == R.ADAPTER_BYTES + R.ORCH_SAVE_BYTES + R.MERGED_BYTES
    assert r.checkpoint.async_save is R.Inputs().async_save is True


def test_async_save_blocks_for_the_safetensors_and_the_staging_only():
    w, bg = 2**30, R.ORCH_SAVE_BYTES
    a, sync = R.Inputs(), R.Inputs(async_save=False)
    assert a.orch_save_s == pytest.approx(bg / 8 / 10e9)  # the shipped recipe: no adapter safetensors per save
    assert a.orch_background_s == pytest.approx(bg / w)
    with_adapter = R.Inputs(orch_save_bytes=R.ORCH_SAVE_BYTES + R.ADAPTER_BYTES, orch_sync_bytes=R.ADAPTER_BYTES)
    assert with_adapter.orch_save_s == pytest.approx(R.ADAPTER_BYTES / w + bg / 8 / 10e9)
    assert sync.orch_save_s == pytest.approx(R.ORCH_SAVE_BYTES / w) and sync.orch_background_s == 0
    sc = R.priced(FIELD, a)
    assert (sc.save_s, sc.save_bg_s) == (a.orch_save_s, a.orch_background_s)
    text = R.format_report(R.ett_report(FIELD, a, seeds=2))
    assert "async_save" in text and "10 GB/s" in text and "in the background" in text


def test_a_crash_during_the_background_write_loses_that_save():
    """The save in flight is no resume point: more steps redone than with synchronous saves, same saves paid."""
    base = Scenario(per_step={"fla_backward_oom": 1 / 300}, save_steps=50, save_s=5.0, total_steps=5000)
    slow = replace(base, save_bg_s=20 * base.step_s)
    seeds = range(20)
    lost = [sum(simulate(sc, "orchestrator", s, NO_GUARDS).lost["lost_progress"] for s in seeds) for sc in (base, slow)]
    assert lost[1] > lost[0] * 1.2


def test_an_interval_shorter_than_the_background_write_waits_for_it():
    sc = Scenario(total_steps=1000, save_steps=100, save_s=10.0, save_bg_s=100 * 18.0 + 50)
    r = simulate(sc, "orchestrator", 0)
    assert r.lost["checkpoint"] == pytest.approx(9 * (10.0 + 50.0))
    assert simulate(replace(sc, save_bg_s=100.0), "orchestrator", 0).lost["checkpoint"] == pytest.approx(9 * 10.0)


def test_auto_interval_is_at_least_the_background_write():
    from orchestrator.domain.interval import Evidence, choose
    c = choose(Evidence(1.0, "x", 18.0, "x", 0, 0.0, "x", background_s=1000.0))
    assert c.steps == math.ceil(1000 / 18) and "background write of 1000 s" in c.clamped
    assert choose(Evidence(1.0, "x", 18.0, "x", 0, 0.0, "x")).steps == 10


def test_priced_charges_each_loop_its_own_saves_waits_and_starts():
    i = R.Inputs(save_steps=100, write_bytes_per_s=2**30)
    sc = R.priced(Scenario(total_steps=1000), i)
    orch, plain = simulate(sc, "orchestrator", 0), simulate(sc, "plain", 0)
    assert orch.lost["checkpoint"] == pytest.approx(9 * i.orch_save_s + i.orch_final_bytes / 2**30)
    assert plain.lost["checkpoint"] == pytest.approx(9 * i.plain_save_s)  # the merged copy at every save


@pytest.mark.parametrize("cls, wait", [("fla_backward_oom", 5.0), ("nccl_error", 30.0)])
def test_verified_ready_wait_replaces_the_fixed_one(cls, wait):
    sc = Scenario(per_hour={cls: 0.5}, ready_s=5.0)
    r = simulate(sc, "orchestrator", seed=5, supervisor=NO_GUARDS)
    assert r.lost["wait"] == pytest.approx(wait * sum(r.crashes.values()))
    assert simulate(sc, "plain", seed=5).lost["wait"] == pytest.approx(90.0 * sum(simulate(sc, "plain", 5).crashes.values()))


def test_startup_ratio_applies_to_relaunches_only():
    sc = Scenario(per_step={"fla_backward_oom": 1 / 500}, startup_ratio=0.5)
    r = simulate(sc, "orchestrator", seed=1, supervisor=NO_GUARDS)
    assert r.lost["startup"] == pytest.approx(480.0 + 240.0 * (r.launches - 1))


def test_auto_interval_follows_the_evidence():
    """save_steps = auto: Daly's interval at every launch from the crashes seen; more crashes, shorter intervals."""
    costly = {"orch_save_bytes": R.ORCH_SAVE_BYTES + R.ADAPTER_BYTES, "orch_sync_bytes": R.ADAPTER_BYTES}  # 30 s
    calm, rough = (R.priced(FIELD, R.Inputs(crash_rate_per_h=rate, **costly)) for rate in (0.1, 2.0))
    a, b = simulate(calm, "orchestrator", 3), simulate(rough, "orchestrator", 3)
    assert a.intervals[0] == b.intervals[0]  # the same prior at the first launch
    assert max(b.intervals[-5:]) < a.intervals[0] < min(a.intervals[-3:])
    with pytest.raises(ValueError, match="plain"):
        simulate(replace(FIELD, save_steps="auto"), "plain", 0)


def test_crash_rate_scales_the_mix():
    sc = R.at_crash_rate(HARSH, 1.0)
    assert R.crashes_per_hour(sc) == pytest.approx(1.0)
    assert sc.per_hour["nccl_error"] / sc.per_hour["cuda_fatal"] == pytest.approx(48 / 10)


def test_simulate_command(tmp_path):
    import json as _json
    from click.testing import CliRunner
    from orchestrator.ops.cli import main
    out = CliRunner().invoke(main, ["simulate", "--mix", "harsh", "--seeds", "4", "--json"])
    assert out.exit_code == 0, out.output
    d = _json.loads(out.output)
    assert d["mix"] == "harsh" and set(d) >= {"mix", "orchestrator", "plain", "inputs"}
    for loop in LOOPS:
        assert 0 < d[loop]["ett"] < 1 and set(d[loop]["lost"]) == set(KINDS[1:])
    assert d["inputs"]["save_steps"] == "auto" and d["inputs"]["ready_s"] == 5.0
    text = CliRunner().invoke(main, ["simulate", "--seeds", "2", "--save-steps", "100", "--fixed-wait"]).output
    assert "orchestrator ETT" in text and "plain" in text and "sleep 90" in text and "after the fixed" in text
    quick = _json.loads(CliRunner().invoke(
        main, ["simulate", "--mix", "harsh", "--seeds", "4", "--json", "--startup-s", "120"]).output)
    assert d["inputs"]["startup_s"] == 480.0 and quick["inputs"]["startup_s"] == 120.0
    for loop in LOOPS:  # both loops start the same model on the same node
        assert quick[loop]["lost"]["startup"] < d[loop]["lost"]["startup"] / 2
    for bad in (["--save-steps", "0"], ["--crash-rate", "-1"], ["--write-gib-s", "0"], ["--startup-s", "0"]):
        r = CliRunner().invoke(main, ["simulate", *bad])
        assert r.exit_code == 2 and "error" in r.output


# --- issue 23: slowdowns (domain/simulate/slow_schedule.py), `simulate --slowdown` ------------------------------------
SLOW = replace(Scenario(name="slow", total_steps=4000), slowdowns=((0.2, 0.5),))


@pytest.mark.parametrize("text, expect", [
    ("0.1:0.66", (0.1, 0.66)), ("1:0.5", (1.0, 0.5)), ("0.05:1", (0.05, 1.0)),
    ("0.1", None), ("0:0.5", None), ("1.5:0.5", None), ("0.1:0", None), ("0.1:1.2", None), ("a:b", None),
    ("0.1:0.5:2", None), ("", None),
])
def test_parse_slowdown(text, expect):
    if expect is None:
        with pytest.raises(ValueError, match="SHARE:SPEED"):
            SS.parse_slowdown(text)
    else:
        assert SS.parse_slowdown(text) == expect


def test_slow_schedule_is_seeded_per_hour_and_wall_inverts_steps():
    a, b = SS.SlowSchedule(((0.3, 0.5),), seed=4), SS.SlowSchedule(((0.3, 0.5),), seed=4)
    assert [b.hour_speed(h) for h in range(200)][::-1] == [a.hour_speed(h) for h in range(199, -1, -1)]
    share = sum(a.hour_speed(h) < 1 for h in range(2000)) / 2000
    assert share == pytest.approx(0.3, abs=0.04)
    for t0, n in ((0.0, 1000), (1234.5, 7777.3), (50_000.0, 3)):
        w = a.wall(t0, n, 18.0)
        assert w >= n * 18.0 and a.steps_in(t0, t0 + w, 18.0) == pytest.approx(n)
    assert SS.SlowSchedule().wall(10.0, 5, 2.0) == 10.0 and SS.SlowSchedule().restart_step(0, 0, 1e9, 1, 10, 1.5, 60, 0) is None


def test_detection_needs_the_ratio_the_window_and_the_hour_limit():
    s = SS.SlowSchedule(((1.0, 0.5),))   # every hour at half speed
    assert s.detection(100.0, 10_000.0, 1.5, 720.0, -math.inf) == 820.0
    assert s.detection(100.0, 800.0, 1.5, 720.0, -math.inf) is None          # the attempt ends first
    assert s.detection(100.0, 10_000.0, 1.5, 720.0, 5000.0) == 5000.0        # restarted within the hour
    assert SS.SlowSchedule(((1.0, 0.7),)).detection(0.0, 1e6, 1.5, 720.0, -math.inf) is None  # 1.43x: not told
    s.clear(1000.0)                                                          # a restart fixed hour 0
    assert s.detection(1000.0, 10_000.0, 1.5, 720.0, -math.inf) == 3600.0 + 720.0


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sc", [SLOW, replace(SLOW, on_slowdown="restart"), replace(HARSH, slowdowns=((0.1, 0.66),),
                                                                                    on_slowdown="restart")],
                         ids=["warn", "restart", "harsh restart"])
def test_slowdowns_are_charged_once(sc, loop):
    for seed in range(3):
        r = simulate(sc, loop, seed)
        assert r.completed and r.productive_s == pytest.approx(sc.ideal_s)
        assert r.productive_s + sum(r.lost.values()) == pytest.approx(r.wall_s)
        assert sum(r.by_class.values()) == pytest.approx(sum(r.lost.values()))
        assert r.lost["slow"] > 0


def test_without_slowdowns_nothing_is_slow():
    for loop in LOOPS:
        assert simulate(HARSH, loop, 3).lost["slow"] == 0
        assert simulate(replace(HARSH, on_slowdown="restart"), loop, 3) == simulate(HARSH, loop, 3)


def test_the_plain_loop_and_warn_train_through_it_at_its_speed():
    # no crashes, no save cost: 20 % of the hours at half speed make their steps twice as long
    plain, warn = simulate(SLOW, "plain", 1), simulate(SLOW, "orchestrator", 1)
    assert plain.lost["slow"] == pytest.approx(warn.lost["slow"], rel=0.05)
    slow_hours = sum(SS.SlowSchedule(SLOW.slowdowns, 1).hour_speed(h) < 1 for h in range(int(plain.wall_s // 3600) + 1))
    assert 0 < plain.lost["slow"] <= slow_hours * 3600 / 2 + 1
    assert warn.slow_restarts == 0 and plain.slow_restarts == 0


def test_restart_pays_when_it_fixes_and_costs_when_it_does_not():
    seeds = range(8)
    warn = summarize([simulate(SLOW, "orchestrator", s) for s in seeds]).ratio
    fixes = [simulate(replace(SLOW, on_slowdown="restart", slow_restart_fixes=1.0), "orchestrator", s) for s in seeds]
    never = summarize([simulate(replace(SLOW, on_slowdown="restart", slow_restart_fixes=0.0, startup_s=600),
                                  "orchestrator", s) for s in seeds]).ratio
    assert summarize(fixes).ratio > warn > never
    for r in fixes:   # at most one restart per hour of wall time
        assert 0 < r.slow_restarts <= r.wall_s / 3600 + 1
        assert r.by_class.get("slowdown_restart", 0) > 0   # its exits and start-ups, charged to it


def test_simulate_command_slowdown():
    import json as _json

    from click.testing import CliRunner

    from orchestrator.ops.cli import main
    args = ["simulate", "--seeds", "3", "--json", "--slowdown", "0.1:0.66", "--slowdown", "0.05:0.3"]
    d = _json.loads(CliRunner().invoke(main, args + ["--on-slowdown", "restart"]).output)
    assert d["inputs"]["slowdowns"] == [[0.1, 0.66], [0.05, 0.3]] and d["inputs"]["on_slowdown"] == "restart"
    assert d["plain"]["lost"]["slow"] > 0 and d["orchestrator"]["lost"]["slow"] > 0
    text = CliRunner().invoke(main, ["simulate", "--seeds", "2", "--slowdown", "0.1:0.66"]).output
    assert "10% of hours at 0.66x speed" in text and "nothing notices" in text and "on_slowdown warn" in text
    for bad in (["--slowdown", "0.1"], ["--slowdown", "0.7:0.5", "--slowdown", "0.5:0.5"],
                ["--on-slowdown", "stop"]):
        r = CliRunner().invoke(main, ["simulate", *bad])
        assert r.exit_code == 2 and ("error" in r.output.lower()), r.output
