"""checkpoint.save_steps = "auto" (orchestrator/domain/interval.py, node_history.py): table tests of the chooser."""
from __future__ import annotations

import math

import pytest

from orchestrator.domain import interval as I
from orchestrator.host.node_history import NodeHistory
from orchestrator.types import Attempt, CrashClass

H = I.HOUR
GIB = 2**30


def ev(save_s=100.0, step_s=18.0, failures=0.0, hours=0.0) -> I.Evidence:
    return I.Evidence(save_s, "s", step_s, "t", failures, hours, "f")


@pytest.mark.parametrize("e, steps, clamped", [
    # prior only: MTBF 2.25 h = 8100 s; Young sqrt(2 x 100 x 8100) = 1273 s; Daly 1273 x (1 + sqrt(100/16200)/3
    # + 100/16200/9) - 100 = 1207 s = 67 steps of 18 s
    (ev(), 67, ""),
    (ev(save_s=400.0), 127, ""),                                    # 4x the cost: ~2x the interval
    (ev(failures=98, hours=45.5), 30, ""),                          # MTBF 0.5 h: Young 600 s, Daly 535 s
    (ev(save_s=1.0, step_s=18.0), 10, "raised"),                   # Young says 7: min_steps
    (ev(save_s=500.0, step_s=0.1, failures=0, hours=1000.0), 144000, "lowered"),  # 11.8 h: the 4 h cap
    (ev(save_s=3000.0, step_s=60.0, failures=998, hours=0.5), 50, "raised"),   # T >= C
])
def test_choose(e, steps, clamped):
    c = I.choose(e)
    assert c.steps == steps
    assert c.clamped.startswith(clamped) if clamped else c.clamped == ""
    assert c.interval_s == pytest.approx(steps * e.step_s)
    assert c.young_s == pytest.approx(math.sqrt(2 * e.save_s * e.mtbf_s))
    assert "Young/Daly" in c.reason and c.as_dict()["steps"] == steps


def test_young_is_the_first_order_optimum_and_daly_is_close():
    e = ev(save_s=120.0)
    young = I.expected_goodput(math.sqrt(2 * e.save_s * e.mtbf_s), e.save_s, e.mtbf_s)
    for t in (0.5, 0.9, 1.1, 2.0):
        assert I.expected_goodput(t * math.sqrt(2 * e.save_s * e.mtbf_s), e.save_s, e.mtbf_s) < young
    assert I.choose(e).expected_goodput == pytest.approx(young, abs=0.003)


@pytest.mark.parametrize("save_s, mtbf_s", [(100.0, 8100.0), (1.0, 1e6), (500.0, 1800.0), (3000.0, 1000.0)])
def test_daly_is_shorter_than_young_and_at_most_the_mtbf(save_s, mtbf_s):
    assert 0 < I.daly(save_s, mtbf_s) <= min(mtbf_s, math.sqrt(2 * save_s * mtbf_s))


@pytest.mark.parametrize("failures, hours, mtbf_h", [(0, 0, 2.25), (2, 4.5, 2.25), (18, 175.5, 9.0), (98, 45.5, 0.5)])
def test_mtbf_posterior(failures, hours, mtbf_h):
    assert ev(failures=failures, hours=hours).mtbf_s == pytest.approx(mtbf_h * H)


def att(n, start, end, cls=None, **kw) -> Attempt:
    return Attempt(n, start, ended_at=end, cls=cls, **kw)


def test_run_failures_counts_training_faults_and_training_hours_only():
    rows = [att(1, 0, 3600, CrashClass.FLA_BACKWARD_OOM, first_step_at=600),
            att(2, 3700, 3730, CrashClass.PORT_IN_USE),                     # at launch: no step, no fault of the node
            att(3, 3800, 4000, CrashClass.COLD_START_OOM),                  # before the first step: no steps lost
            att(4, 4100, 7400, CrashClass.DISK_FULL, first_step_at=4600),
            att(5, 7500, 9000, None, first_step_at=8000),                   # stopped
            att(6, 9000, None, first_step_at=9500)]                         # running
    assert I.run_failures(rows, now=10_800) == (1, pytest.approx((3000 + 2800 + 1000 + 1300) / H))


def test_measured_step_time_leaves_saves_out():
    rows = [att(1, 0, 2000, first_step_at=500, last_step_at=1500, start_step=0, end_step=51, save_s=100.0, save_count=1)]
    assert I.measured_step_s(rows) == pytest.approx((1000 - 100) / 50)
    assert I.measured_step_s([att(1, 0, 10)]) is None


def test_evidence_prior_then_measured():
    e = I.evidence([], (0, 0), 174 * GIB, None, 18.0, "default for the model", 0)
    assert e.save_s == pytest.approx(174.0) and "prior" in e.save_source and "default write speed" in e.save_source
    assert e.step_s == 18.0 and e.failures == 0
    rows = [att(1, 0, 7800, CrashClass.NCCL_ERROR, first_step_at=600, last_step_at=7000, start_step=0, end_step=321,
                save_s=80.0, save_count=3)]
    e = I.evidence(rows, (4, 20.0), 174 * GIB, None, 18.0, "x", 7800)
    assert e.save_s == 80.0 and "measured (3 saves" in e.save_source
    assert e.step_s == pytest.approx((6400 - 240) / 320) and e.step_source == "measured"
    assert (e.failures, e.hours) == (5, pytest.approx(22.0))
    assert I.choose(e).steps < I.choose(I.evidence([], (0, 0), 174 * GIB, None, 18.0, "x", 0)).steps


def test_async_save_prior_is_the_blocking_part_and_the_background_write_stays_after_a_measurement():
    # 397B: 28.3 GiB adapter written before training goes on + 145.6 GiB of shards staged by 8 GPUs, then
    # written in the background
    bg = 145.6 * GIB
    e = I.evidence([], (0, 0), 173.9 * GIB, None, 18.0, "x", 0, bg, 8)
    assert e.save_s == pytest.approx(28.3 + bg / 8 / I.D2H_BYTES_PER_S)
    assert e.background_s == pytest.approx(145.6) and "145.6 GiB of it written in the background" in e.save_source
    sync = I.evidence([], (0, 0), 173.9 * GIB, None, 18.0, "x", 0)
    assert I.choose(e).steps < I.choose(sync).steps, "a cheaper pause: saves more often"
    assert I.choose(e).interval_s >= e.background_s, "the next save never waits for the last one"
    rows = [att(1, 0, 7800, CrashClass.NCCL_ERROR, first_step_at=600, last_step_at=7000, start_step=0, end_step=321,
                save_s=31.0, save_count=3)]
    measured = I.evidence(rows, (0, 0), 173.9 * GIB, None, 18.0, "x", 7800, bg, 8)
    assert measured.save_s == 31.0 and measured.background_s == pytest.approx(145.6)


def test_starting_choice_follows_the_write_speed():
    slow = I.starting_choice(174 * GIB, 18.0, write_bytes_per_s=0.25 * GIB)
    fast = I.starting_choice(174 * GIB, 18.0, write_bytes_per_s=4 * GIB)
    assert slow.steps > fast.steps and slow.evidence.save_s == pytest.approx(696.0)


def test_node_history_keeps_each_run_and_survives_garbage(tmp_path):
    node = NodeHistory(tmp_path)
    assert node.others("a") == (0.0, 0.0)
    assert node.record("a", 2, 10.0, 1.0) is None
    node.record("b", 1, 5.0, 2.0)
    node.record("a", 3, 12.0, 3.0)  # rewritten, not added
    assert node.others("c") == (4.0, 17.0) and node.others("a") == (1.0, 5.0)
    node.path.write_text("{not json")
    assert node.others("a") == (0.0, 0.0)
    (tmp_path / "a-file").write_text("")
    why = NodeHistory(tmp_path / "a-file" / "sub").record("a", 1, 1.0, 1.0)  # not writable: said, not raised
    assert why and "node.json" in why
