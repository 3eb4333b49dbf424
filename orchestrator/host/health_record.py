"""Recording a run-health finding: the journal event with its numbers (and the action taken), and the metrics
(orchestrator_health_events_total{kind}, the supervisor alert the kind raises or clears). The one call the
loop makes per finding; the decisions are domain/health_action.py's."""
from __future__ import annotations

from orchestrator.domain.health import Finding
from orchestrator.domain.health_action import HealthAction
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics


def record_finding(journal: Journal, metrics: Metrics | None, finding: Finding,
                   action: HealthAction | None = None) -> None:
    """Journal one finding under its kind, with its numbers and the action's, and count it in the metrics."""
    journal.event(finding.kind, finding.message, **finding.record(), **(action.record() if action else {}))
    if metrics is not None:
        metrics.health_event(finding.kind)
