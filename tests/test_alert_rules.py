"""monitoring/: alert rules (promtool + a real Prometheus), dashboard, and runbook coverage."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.host.metrics import RAISED_BY_SUPERVISOR, Metrics
from orchestrator.types import Alert, CrashClass, GpuInfo, GpuSnapshot, State
from prom import ALERT_RULES as ALERTS
from prom import firing, needs_prometheus, poll, query, running_prometheus

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
RUNBOOKS = ROOT / "runbooks"
RUNBOOK_BASE = "https://orchestrator.invalid/runbooks/"
# Series Prometheus itself creates for every target; everything else must come from Metrics.
PROMETHEUS_BUILTINS = {"up"}
EXPECTED_ALERTS = {
    "OrchestratorCrashLoop", "OrchestratorCheckpointStale", "OrchestratorNoTrainingProgress",
    "OrchestratorInvalidCheckpoint", "OrchestratorSyncLagging", "OrchestratorGpusNotClear",
    "OrchestratorNanOrDivergence", "OrchestratorSupervisorDown", "OrchestratorGaveUp",
    "OrchestratorDiskFull", "OrchestratorNodeExcluded", "OrchestratorTrainingUnhealthy",
    "OrchestratorThroughputDrop", "OrchestratorCheckpointUnchanged", "OrchestratorProgressUnreadable",
}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)")


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def exposed_names() -> set[str]:
    """Sample names a Metrics instance exposes (labelled gauges materialised first)."""
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics()
    m.set_info("run", "hash", "megatron", "model")
    m.gpu_memory(GpuSnapshot(gpus=(GpuInfo(0, "gpu", 1, 0),)))
    fams = text_string_to_metric_families(m.exposition().decode())
    return {s.name for f in fams for s in f.samples}


def referenced_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: orchestrator_* tokens and any name before { or [."""
    names = set(re.findall(r"\b(orchestrator_[a-z0-9_]+)\b", expr))
    names |= {n for n in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr)}
    return names


# ---------------------------------------------------------------- promtool


@needs_promtool
def test_promtool_check_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests():
    r = subprocess.run([PROMTOOL, "test", "rules", str(MONITORING / "alerts_test.yml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- rule structure


def test_all_expected_alerts_are_defined():
    assert {r["alert"] for r in alert_rules()} == EXPECTED_ALERTS


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_has_severity_annotations_and_an_existing_runbook(rule):
    assert rule["labels"]["severity"] in {"critical", "warning"}
    ann = rule["annotations"]
    for key in ("summary", "description", "runbook_url"):
        assert ann.get(key, "").strip(), f"{rule['alert']} lacks {key}"
    url = ann["runbook_url"]
    assert url.startswith(RUNBOOK_BASE) and url.endswith(".md"), url
    assert (RUNBOOKS / url.removeprefix(RUNBOOK_BASE)).is_file(), url


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_uses_only_exposed_metrics(rule):
    unknown = referenced_names(rule["expr"]) - exposed_names() - PROMETHEUS_BUILTINS
    assert not unknown, f"{rule['alert']} uses metrics Metrics does not expose: {unknown}"


# ---------------------------------------------------------------- the closed set: enum, rules, runbooks


def rule_of(alert: Alert) -> dict:
    (rule,) = [r for r in alert_rules() if r["labels"].get("alert") == alert.value]
    return rule


def test_rules_and_the_alert_enum_are_one_set():
    labels = [r["labels"].get("alert") for r in alert_rules()]
    assert sorted(labels) == sorted(a.value for a in Alert), "each rule names one Alert member, each member one rule"


def test_every_alert_has_a_runbook_heading_and_an_index_row():
    index = (RUNBOOKS / "README.md").read_text().splitlines()
    for alert in Alert:
        rule = rule_of(alert)
        page = RUNBOOKS / rule["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE)
        headings = [line for line in page.read_text().splitlines() if line.startswith("#")]
        assert any(rule["alert"] in h and f"`{alert}`" in h for h in headings), \
            f"{page.name} needs a heading naming {rule['alert']} and `{alert}`"
        rows = [line for line in index if line.startswith(f"| {rule['alert']} |")]
        assert len(rows) == 1 and f"`{alert}`" in rows[0] and f"]({page.name})" in rows[0], rows


@pytest.mark.parametrize("alert", list(Alert), ids=str)
def test_each_alert_has_one_owner(alert):
    """The supervisor raises and clears RAISED_BY_SUPERVISOR (orchestrator_alert_active); Prometheus
    derives every other alert from the metrics, so its rule never reads an alert_active series."""
    raised = set(re.findall(r'orchestrator_alert_active\{alert="(\w+)"\}', rule_of(alert)["expr"]))
    if alert in RAISED_BY_SUPERVISOR:
        assert raised == {alert.value}
    else:
        assert raised <= {a.value for a in RAISED_BY_SUPERVISOR} - {alert.value}  # at most as a condition


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    doc = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())
    firing, quiet = set(), set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert EXPECTED_ALERTS - firing == set(), "alerts without a firing case"
    assert EXPECTED_ALERTS - quiet == set(), "alerts without a non-firing case"


# ---------------------------------------------------------------- dashboard


def dashboard_exprs(node) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "query") and isinstance(v, str):
                yield v
            else:
                yield from dashboard_exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from dashboard_exprs(v)


def load_dashboard_exprs() -> list[str]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [e for part in ("panels", "templating", "annotations") for e in dashboard_exprs(dash[part])]


def test_dashboard_is_valid_and_uses_only_exposed_metrics():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dash["title"] and dash["uid"] and 36 <= dash["schemaVersion"] <= 41
    exprs = load_dashboard_exprs()
    assert len(exprs) >= 14
    names = exposed_names()
    for expr in exprs:
        unknown = referenced_names(expr) - names - PROMETHEUS_BUILTINS
        assert not unknown, f"{expr!r} uses {unknown}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path):
    # promtool parses PromQL when checking recording rules; Grafana variables become constants
    # (label_values() is Grafana's own variable query, not PromQL).
    subst = {"$__rate_interval": "5m", "$instance": ".*"}
    rules = []
    promql = [e for e in load_dashboard_exprs() if ("(" in e or "{" in e) and not e.startswith("label_values(")]
    for i, expr in enumerate(promql):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- runbooks


@pytest.mark.parametrize("cls", list(CrashClass), ids=str)
def test_every_crash_class_has_a_runbook(cls):
    page = RUNBOOKS / f"{cls.value}.md"
    assert page.is_file()
    text = page.read_text()
    for section in ("## What it looks like", "## What orchestrator already did", "## What to check"):
        assert section in text, f"{page.name} lacks {section!r}"


def test_runbook_index_links_every_page():
    index = (RUNBOOKS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}
    assert pages - linked == set(), "pages missing from runbooks/README.md"
    assert {p for p in linked if not (RUNBOOKS / p).is_file()} == set(), "dead links in the index"


# ---------------------------------------------------------------- a real Prometheus


@pytest.mark.prometheus
@needs_prometheus
def test_crash_loop_fires_in_a_real_prometheus(tmp_path: Path):
    # The shipped rule works as is: `for: 0m`, and [1h] needs no rewrite because the counters are
    # pre-created at 0, so the first scrape gives increase() its baseline.
    m = Metrics()
    m.set_state(State.RUNNING)
    port = m.serve("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        with running_prometheus(tmp_path, [target], [ALERTS]) as base:
            # Baseline: at least one scrape has seen the crash counters at 0.
            poll(lambda: query(base, 'orchestrator_crashes_total{class="nccl_error"} == 0'), 30,
                 "the first scrape of the zero crash counters")
            assert not firing(base, "OrchestratorCrashLoop")
            for cls in (CrashClass.NCCL_ERROR, CrashClass.NCCL_ERROR, CrashClass.COLD_START_OOM,
                        CrashClass.OOM_DURING_TRAINING):
                m.crash(cls)

            def crash_loop_firing():
                m.tick(time.time())  # keep the heartbeat fresh like the supervisor loop does
                return firing(base, "OrchestratorCrashLoop")

            alerts = poll(crash_loop_firing, 60, "OrchestratorCrashLoop to fire")
            assert alerts[0]["labels"]["instance"] == target
            assert alerts[0]["labels"]["severity"] == "critical"
            assert alerts[0]["annotations"]["runbook_url"].endswith("/crash-loop.md")
    finally:
        m.close()

