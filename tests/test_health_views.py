"""How health events show: `history --json` (every event with its numbers), `status` (counts and the newest),
the live view, and the HTML report (markers on the loss curve, a table). From a journal written the way the
loop records a finding: Journal.event(kind, message, **finding.record(), **action.record())."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from rich.console import Console
from supervised import fake_recipe
from html_page import Page

from orchestrator.domain.health.kinds import Finding
from orchestrator.config.recipe import load
from orchestrator.domain.health.action import decide
from orchestrator.host.journal import Journal, journal_path
from orchestrator.ops import report, status_view
from orchestrator.store.rundir import state_dir
from orchestrator.types import Attempt, HealthKind

EVIL = '<script>alert("x")</script>'
SPIKE = Finding(HealthKind.LOSS_SPIKE, "loss 8.1 at step 12 is a spike", 12, 12, 20, 2.0, 6.0, 8.1)
DIVERGENCE = Finding(HealthKind.LOSS_DIVERGENCE, f"the loss level is 2.5, over 2.1 {EVIL}", 21, 40, 20, 1.42, 2.13, 2.5)
UNREADABLE = Finding(HealthKind.PROGRESS_UNREADABLE, "3 log lines ... Sample: iteration 5/50 | lm loss: 2.0",
                     details={"sample": "iteration 5/50 | lm loss: 2.0", "lines": 3})


@pytest.fixture
def journalled(tmp_path: Path):
    recipe = fake_recipe(tmp_path, iterations=50)
    r = load(recipe)
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logging.jsonl").write_text("".join(
        json.dumps({"loss": 2.0 if k < 21 else 2.5, "iteration": f"{k}/50"}) + "\n" for k in range(1, 45)))
    j = Journal(journal_path(state_dir(out)))
    now = time.time()
    j.record_attempt(Attempt(1, now - 60, start_step=0, end_step=44, ended_at=now - 1, exit_code=None,
                             first_step_at=now - 55, last_step_at=now - 2))
    j.record_checkpoint(20, str(out / "checkpoint-20"), True, loss=2.0)
    j.event("launch", "attempt 1 fresh")
    for f in (SPIKE, UNREADABLE, DIVERGENCE):
        j.event(f.kind, f.message, **f.record(), **decide(f, "stop", [20]).record())
    j.put(state="gave_up", step=44, attempt=1, output_dir=str(out), recipe_hash="abc123", updated_at=now,
          exit_reason=f"loss_divergence: {DIVERGENCE.message}")
    j.close()
    ro = Journal(journal_path(state_dir(out)), readonly=True)
    yield r, ro, tmp_path
    ro.close()


def test_history_json_lists_every_health_event_with_its_numbers(journalled):
    r, j, _ = journalled
    h = report.history_data(r, j)["health"]
    assert [ev["kind"] for ev in h] == [HealthKind.LOSS_SPIKE, HealthKind.PROGRESS_UNREADABLE, HealthKind.LOSS_DIVERGENCE]
    div = h[2]["data"]
    assert div == {"first_step": 21, "last_step": 40, "window": 20, "level": 1.42, "threshold": 2.13, "value": 2.5,
                   "action": "stop"}
    assert h[1]["data"]["sample"].startswith("iteration 5/50")
    json.dumps(h)  # as `history --json` prints it
    assert "health: loss_divergence: the loss level is 2.5" in report.history_table(report.history_data(r, j))


def test_status_counts_health_events_and_shows_the_newest(journalled):
    r, j, _ = journalled
    d = report.status_data(r, j)
    assert d["health"]["counts"] == {HealthKind.LOSS_SPIKE: 1, HealthKind.PROGRESS_UNREADABLE: 1, HealthKind.LOSS_DIVERGENCE: 1}
    assert d["health"]["last"]["kind"] == HealthKind.LOSS_DIVERGENCE
    console = Console(record=True, width=160, force_terminal=True, color_system=None)
    status_view.status_view(r, j, console=console)
    text = console.export_text()
    assert "loss_spike ×1" in text and "last: loss_divergence: the loss level is 2.5" in text


def test_the_report_marks_health_events_on_the_loss_curve(journalled):
    r, j, tmp = journalled
    text = Path(report.write_html(r, j, tmp / "r.html")).read_text()
    page = Page(text)
    assert not page.errors and not page.stack
    marks = page.find("g", "health")
    # the events with steps are marked; progress_unreadable has none (it is in the table)
    assert [m["data-kind"] for m in marks] == [HealthKind.LOSS_SPIKE, HealthKind.LOSS_DIVERGENCE]
    assert any(t.startswith("loss_divergence (steps 21-40, found 19 steps after the onset): the loss level is 2.5")
               for t in page.titles)
    # the divergence is shaded from its onset to the finding, the delay written in the band; a one-step
    # spike has no band and no delay
    band = re.search(r'<g class="health" data-kind="loss_divergence">.*?</g>', text, re.S)
    assert band and "<rect" in band.group(0)
    assert "loss_divergence: onset 21, found at 40 (19 steps after the onset)" in band.group(0)
    spike = re.search(r'<g class="health" data-kind="loss_spike">.*?</g>', text, re.S)
    assert spike and "<rect" not in spike.group(0) and "onset" not in spike.group(0)
    assert "<h2>Health</h2>" in text and "progress_unreadable" in text
    assert EVIL not in text and "&lt;script&gt;" in text


def test_a_run_without_health_events_has_no_health_section(tmp_path):
    r = load(fake_recipe(tmp_path, iterations=10))
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    j = Journal(journal_path(state_dir(out)))
    j.event("launch", "attempt 1 fresh")
    try:
        assert report.history_data(r, j)["health"] == []
        assert report.status_data(r, j)["health"] == {"counts": {}, "last": None}
        text = Path(report.write_html(r, j, tmp_path / "r.html")).read_text()
    finally:
        j.close()
    assert "<h2>Health</h2>" not in text and 'class="health"' not in text


def test_the_report_has_a_throughput_panel_with_the_slow_spell_shaded():
    from orchestrator.ops.html_report import slow_spells, throughput_chart

    drop = {"kind": "throughput_drop", "message": "step 30: 2 s/step, 2.00x the baseline",
            "data": {"step": 30, "current_s": 2.0, "baseline_s": 1.0, "ratio": 2.0}}
    back = {"kind": "throughput_recovered", "message": "step 45: back", "data": {"step": 45, "current_s": 1.1,
                                                                                   "baseline_s": 1.0, "ratio": 1.1}}
    assert slow_spells([drop, back], 100) == [(30, 45)]
    assert slow_spells([drop], 100) == [(30, 100)], "a spell still open runs to the last step"
    speed = {"measured": [(s, 1.0 if s < 25 else 2.0) for s in range(12, 60)],
             "current": [(s, 1.0 if s < 27 else 2.0) for s in range(16, 60)], "baselines": [(1, 59, 1.0)],
             "slowdown_ratio": 1.5}
    d = {"max_steps": 100, "speed": speed, "health": [drop, back]}
    svg = throughput_chart(d)
    page = Page(svg)
    assert not page.errors and len(page.find("rect", "slow")) == 1
    assert [m["data-kind"] for m in page.find("g", "throughput")] == ["throughput_drop", "throughput_recovered"]
    assert len(page.find("line", "baseline")) == len(page.find("line", "threshold")) == 1
    assert "no step times" in throughput_chart({"max_steps": 10, "speed": {}, "health": []})
