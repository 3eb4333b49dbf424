"""One detector list (issue 35, item 3): every kind's effects come from domain/health/kinds.py KINDS, and the
detectors HealthWatch runs come from watch.DETECTORS, so a new detector is its module plus one line."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.schema import HealthSection
from orchestrator.domain.health import action
from orchestrator.domain.health.detector import Detector, Snapshot, Start
from orchestrator.domain.health.kinds import DIVERGENCE_KINDS, KINDS, Finding
from orchestrator.domain.health.watch import DETECTORS, HealthWatch
from orchestrator.host.metrics import RAISED_BY_SUPERVISOR, Metrics
from orchestrator.ops.html_report import HEALTH_COLORS
from orchestrator.types import HealthKind, Progress

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]


def test_every_kind_has_one_row_and_the_vocabulary_is_closed():
    assert set(KINDS) == set(HealthKind)
    assert DIVERGENCE_KINDS == {HealthKind.LOSS_DIVERGENCE, HealthKind.LOSS_LIMIT, HealthKind.GRAD_NORM_LIMIT}
    assert HEALTH_COLORS == {k.value: e.colour for k, e in KINDS.items()}   # the report reads the table
    assert {e.alert for e in KINDS.values() if e.raises} <= RAISED_BY_SUPERVISOR
    # the two resume checks no longer share an event or a counter
    loss_check, step_check = KINDS[HealthKind.RESUME_DIVERGENCE], KINDS[HealthKind.RESUMED_AT_WRONG_STEP]
    assert loss_check.counter and step_check.counter and loss_check.counter[0] != step_check.counter[0]
    assert loss_check.counter[0] == "orchestrator_resume_divergence"   # alerts.yml and dashboards read it


def test_each_kind_reaches_the_alert_its_row_names():
    """A kind whose alert a rule fires (not the supervisor) is read by that rule: its label of
    orchestrator_health_events_total{kind} or its own counter."""
    doc = yaml.safe_load((ROOT / "monitoring" / "alerts.yml").read_text())
    rules = {r["labels"]["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "alert" in r}
    for kind, e in KINDS.items():
        if e.alert is None or e.raises:
            continue
        expr = rules[e.alert.value]
        assert kind.value in expr or (e.counter is not None and f"{e.counter[0]}_total" in expr), (kind, expr)


def test_each_kind_has_a_runbook_page_that_names_it():
    for kind, e in KINDS.items():
        page = ROOT / "runbooks" / e.runbook
        assert page.is_file(), (kind, e.runbook)
        assert f"`{kind.value}`" in page.read_text(), (kind, e.runbook)


def test_the_step_check_is_documented_as_renamed():
    readme = (ROOT / "README.md").read_text()
    assert "`resumed_at_wrong_step`" in readme and "Renamed" in readme


# --- a throwaway warn-only detector: its module (here, this function) plus one line in the list --------------

def _wobble(start: Start):
    """Warns once when a logged loss is exactly 4.2 (nothing real: it proves the wiring)."""
    seen: list[int] = []

    def check(snap: Snapshot) -> list[Finding]:
        p = snap.record
        if p is None or p.loss != 4.2 or seen:
            return []
        seen.append(p.step)
        return [Finding(HealthKind.LOSS_SPIKE, f"wobble at step {p.step}", p.step, p.step, value=p.loss)]
    return check


WOBBLE = Detector("wobble", "step", _wobble)


def test_a_registered_detector_is_run_decided_counted_and_drawn():
    cfg = HealthSection()
    watch = HealthWatch(cfg, detectors=DETECTORS + (WOBBLE,))   # the one line
    found = [f for s, loss in enumerate([2.0, 2.0, 4.2, 2.0, 4.2], 1) for f in watch.observe(Progress(step=s, loss=loss))]
    assert [(f.message, f.last_step) for f in found] == [("wobble at step 3", 3)]   # once, not again at step 5
    (f,) = found
    assert action.act(f, action.Situation()).action == "warn"                     # warn-only: no action
    m = Metrics()
    m.health_event(f.kind)
    assert b'orchestrator_health_events_total{kind="loss_spike"} 1.0' in m.exposition()
    assert f.kind in HEALTH_COLORS
    # a relaunch makes the check afresh, and the stock list runs without it
    watch.attempt(None)
    assert [g.message for g in watch.observe(Progress(step=1, loss=4.2))] == ["wobble at step 1"]
    assert HealthWatch(cfg).observe(Progress(step=1, loss=4.2)) == []


def test_no_false_alarm_from_the_stock_detectors_on_a_flat_run():
    watch = HealthWatch(HealthSection())
    assert [f for s in range(1, 200) for f in watch.observe(Progress(step=s, loss=2.0 + 0.01 * (s % 3), grad_norm=1.0))] == []
    assert [f for n in range(50) for f in watch.line(f"info: step {n} saved", float(n))] == []


@pytest.mark.parametrize("kind, want", [
    (HealthKind.LOSS_SPIKE, "warn"), (HealthKind.SKIPPED_STEPS, "warn"), (HealthKind.PROGRESS_UNREADABLE, "warn"),
    (HealthKind.THROUGHPUT_RECOVERED, "warn"), (HealthKind.LOSS_DIVERGENCE, "stop"),
    (HealthKind.GRAD_NORM_LIMIT, "stop"), (HealthKind.RESUME_DIVERGENCE, "rollback"),
    (HealthKind.THROUGHPUT_DROP, "restart"),
])
def test_act_dispatches_on_the_row(kind, want):
    """action.act is the one map: each kind's row picks the rule (the rules themselves: test_health_action.py)."""
    f = Finding(kind, "x", 20, 25)
    sit = action.Situation(on_divergence="stop", on_slowdown="restart", verified_steps=(10,), resumed_from=19,
                           now=10_000.0)
    assert action.act(f, sit).action == want


def test_throughput_is_a_timed_detector_of_the_list_measured_against_earlier_attempts():
    cfg = HealthSection(slowdown_ratio=1.5, slowdown_window_s=8)
    assert [d.name for d in DETECTORS if d.requires == "timed"] == ["throughput"]
    watch = HealthWatch(cfg)
    watch.attempt(None)
    t, step, found = 0.0, 0, []

    def run(n: int, s_per_step: float, now_given: bool = True) -> None:
        nonlocal t, step
        for _ in range(n):
            step, t = step + 1, t + s_per_step
            found.extend(watch.observe(Progress(step=step, loss=2.0), t if now_given else None))

    run(60, 1.0)
    assert watch.throughput is not None and watch.throughput.baseline_s == pytest.approx(1.0)
    watch.paused(step)                     # a save after this step: the next gap is the save's, not training's
    t += 500.0
    run(20, 1.0)
    assert found == []
    # a relaunch onto a degraded machine: slow from its first step, judged against the earlier attempt's baseline
    watch.attempt(step)
    run(60, 3.0)
    assert [f.kind for f in found] == [HealthKind.THROUGHPUT_DROP]
    assert found[0].details["baseline_s"] == pytest.approx(1.0)
    # untimed records (a replay of logged steps) feed the step detectors only
    watch.attempt(step)
    found.clear()
    run(60, 3.0, now_given=False)
    assert found == [] and watch.throughput.baseline_s is None
