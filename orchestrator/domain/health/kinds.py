"""The one vocabulary of run health: the Finding every detector returns, and what each kind raises. Pure.

A finding's kind is a types.HealthKind; it is also the journal event's kind and the label of
orchestrator_health_events_total{kind}. KINDS declares, once per kind, what else it raises: how the supervisor
acts on it (action.py reads `act`), the alert it leads to (raised and cleared by the supervisor, or fired by a
rule in monitoring/alerts.yml that reads its count), a counter of its own, its runbook page and its colour in
the HTML report. host/metrics.py, ops/html_report.py, store/tracker.py and the alert and runbook tests read
this table; nothing else lists kinds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.types import Alert, HealthKind, SetAsideReason

# How the supervisor acts on a kind (action.py):
#   warn           a journal event and the metrics, nothing else
#   on_divergence  health.on_divergence: stop, roll back to before the onset, or warn
#   resume         set aside the checkpoint the attempt resumed from, relaunch once from the one before; stop
#   give_up        stop the trainer and give up (exit 3): retrying cannot help
#   on_slowdown    health.on_slowdown: warn, or a graceful restart at most once an hour
#   set_aside      the checkpoint the finding names stops being a resume point (store/tracker.py)
Act = Literal["warn", "on_divergence", "resume", "give_up", "on_slowdown", "set_aside"]


@dataclass(frozen=True)
class Effects:
    """What one kind raises besides its journal event and its orchestrator_health_events_total{kind} count."""

    act: Act
    runbook: str                           # the page under runbooks/ a person reads about it
    colour: str                            # its marker in the HTML report
    alert: Alert | None = None             # the alert it leads to: raised by the supervisor (`raises`) or
                                           # fired by the alert rule that reads its count
    raises: bool = False                   # the supervisor raises `alert` at this event (orchestrator_alert_active)
    clears: Alert | None = None            # the supervisor alert this event clears
    counter: tuple[str, str] | None = None  # (name, help) of a counter of its own (the name without _total)
    sets_aside: SetAsideReason | None = None  # act "set_aside": the reason the checkpoint is moved under


_TRAINING = "training-unhealthy.md"
_RESUME = "nan-or-divergence.md"
KINDS: dict[HealthKind, Effects] = {
    HealthKind.LOSS_SPIKE: Effects("warn", _TRAINING, "#f28e2b"),
    HealthKind.GRAD_NORM_SPIKE: Effects("warn", _TRAINING, "#e8a33d"),
    HealthKind.LOSS_DIVERGENCE: Effects("on_divergence", _TRAINING, "#c0392b", Alert.TRAINING_UNHEALTHY),
    HealthKind.LOSS_LIMIT: Effects("on_divergence", _TRAINING, "#a61e4d", Alert.TRAINING_UNHEALTHY),
    HealthKind.GRAD_NORM_LIMIT: Effects("on_divergence", _TRAINING, "#a61e4d", Alert.TRAINING_UNHEALTHY),
    HealthKind.RESUME_DIVERGENCE: Effects(
        "resume", _RESUME, "#6f42c1", Alert.NAN_OR_DIVERGENCE,
        counter=("orchestrator_resume_divergence", "Resumes whose loss diverged from the loss logged before.")),
    HealthKind.RESUMED_AT_WRONG_STEP: Effects(
        "give_up", _RESUME, "#9467bd", Alert.NAN_OR_DIVERGENCE,
        counter=("orchestrator_resumed_at_wrong_step",
                 "Resumes whose first logged step did not follow the checkpoint resumed from.")),
    HealthKind.PROGRESS_UNREADABLE: Effects("warn", "progress-unreadable.md", "#7f7f7f", Alert.PROGRESS_UNREADABLE,
                                            raises=True),
    HealthKind.THROUGHPUT_DROP: Effects("on_slowdown", "throughput-drop.md", "#17becf", Alert.THROUGHPUT_DROP,
                                        raises=True),
    HealthKind.THROUGHPUT_RECOVERED: Effects("warn", "throughput-drop.md", "#2e9d5b", clears=Alert.THROUGHPUT_DROP),
    HealthKind.CHECKPOINT_UNCHANGED: Effects("set_aside", "checkpoint-unchanged.md", "#8c564b",
                                             Alert.CHECKPOINT_UNCHANGED, sets_aside=SetAsideReason.UNCHANGED),
    HealthKind.CHECKPOINT_NONFINITE: Effects("set_aside", "invalid-checkpoint.md", "#8c564b",
                                             sets_aside=SetAsideReason.NONFINITE),
    HealthKind.SKIPPED_STEPS: Effects("warn", _RESUME, "#bcbd22"),
}
# The findings health.on_divergence acts on; spikes only warn.
DIVERGENCE_KINDS = frozenset(k for k, e in KINDS.items() if e.act == "on_divergence")


@dataclass(frozen=True)
class Finding:
    """One health condition, found once: what, over which steps, and the numbers that decided it. Every detector
    (step records, log lines, step times, checkpoint content) returns these."""

    kind: HealthKind
    message: str
    first_step: int | None = None    # where the condition starts (its onset), when it has steps
    last_step: int | None = None     # the step it was found at
    window: int | None = None        # logged steps the level is taken over
    level: float | None = None       # the robust level the value is compared with
    threshold: float | None = None   # the value beyond which it is a finding
    value: float | None = None       # what was seen
    details: dict = field(default_factory=dict)  # more numbers (a resume's before/after, a sample line)
    at: float | None = None          # timed findings (throughput): when it was decided (the caller's clock)
    since: float | None = None       # ... and when the condition began
    subject: str | None = None       # what it is about when not a step: a checkpoint directory

    def record(self) -> dict:
        """The journal event's data: the numbers, rounded for people, without the unset ones."""
        out: dict = {k: v for k, v in (("first_step", self.first_step), ("last_step", self.last_step),
                                       ("window", self.window)) if v is not None}
        for k, v in (("level", self.level), ("threshold", self.threshold), ("value", self.value)):
            if v is not None:
                out[k] = round(v, 6) if math.isfinite(v) else str(v)
        return out | self.details
