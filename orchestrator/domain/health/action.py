"""What to do about a health finding: the one place that maps findings to actions. Pure; table-tested.

`act(finding, situation)` dispatches on what kinds.KINDS declares for the finding's kind (`Effects.act`):

  warn (spikes, skipped_steps,     a journal event, a metric, no action
  progress_unreadable, recovered)
  on_divergence (loss_divergence,  health.on_divergence: "stop" (graceful stop, checkpoints kept, exit 3 with
  loss_limit, grad_norm_limit)     the reason), "rollback" (quarantine the checkpoints saved from the onset on,
                                   relaunch from the newest verified one before it) or "warn". The same symptom
                                   again within a rolled-back step range stops: the data order is deterministic,
                                   so a data-caused divergence recurs.
  resume (resume_divergence)       quarantine the checkpoint the attempt resumed from (and what it saved since),
                                   relaunch once from the verified checkpoint before it; if that diverges too, the
                                   resume path itself is broken: stop.
  on_slowdown (throughput_drop)    health.on_slowdown: "restart" at most once per RESTART_MIN_GAP_S, else warn.
  give_up (resumed_at_wrong_step)  stop and give up: the loop's judge decides it (loop/running.py), not a pass's
                                   health findings.
  set_aside (checkpoint_*)         the tracker moves the checkpoint out of the namespace (store/tracker.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.domain.health.kinds import DIVERGENCE_KINDS, KINDS, Finding
from orchestrator.types import HealthKind

Act = Literal["warn", "stop", "rollback", "restart"]
RESTART_MIN_GAP_S = 3600.0   # on_slowdown = "restart": at most one restart per hour


@dataclass(frozen=True)
class HealthAction:
    """What the loop does about one finding. "rollback": every checkpoint at quarantine_from or later stops
    being a resume point, then a graceful stop and a relaunch from checkpoint relaunch_from. "restart": a
    graceful stop and a relaunch from the newest verified checkpoint."""

    action: Act
    reason: str
    relaunch_from: int | None = None
    quarantine_from: int | None = None

    def record(self) -> dict:
        """The numbers the finding's journal event carries about the action (rollbacks_of reads them back)."""
        out: dict = {"action": self.action}
        if self.relaunch_from is not None:
            out["relaunch_from"] = self.relaunch_from
        if self.quarantine_from is not None:
            out["quarantine_from"] = self.quarantine_from
        return out


@dataclass(frozen=True)
class Rollback:
    """An earlier rollback of this run: the finding's step range and the checkpoint it relaunched from."""

    first_step: int
    last_step: int
    to_step: int


def rollbacks_of(events: Iterable[dict]) -> list[Rollback]:
    """The rollbacks a run's journal events record (Journal.events() rows: kind, data), oldest first; so a
    supervisor restarted mid-run keeps the recurrence rule."""
    out = []
    for e in events:
        d = e.get("data") or {}
        if e.get("kind") in DIVERGENCE_KINDS and d.get("action") == "rollback" and d.get("relaunch_from") is not None:
            out.append(Rollback(int(d.get("first_step", d.get("last_step", 0))), int(d.get("last_step", 0)),
                                int(d["relaunch_from"])))
    return sorted(out, key=lambda r: r.last_step)


def newest_before(step: int, verified_steps: Iterable[int]) -> int | None:
    """The newest verified checkpoint step strictly before `step`."""
    return max((s for s in verified_steps if s < step), default=None)


def recurrence(finding: Finding, rollbacks: Sequence[Rollback]) -> Rollback | None:
    """The earlier rollback whose step range this finding falls into again: its onset is after the checkpoint
    that rollback relaunched from and no later than where the earlier finding was found."""
    onset = finding.first_step if finding.first_step is not None else finding.last_step
    if onset is None:
        return None
    return next((r for r in reversed(rollbacks) if r.to_step < (finding.last_step or onset) and onset <= r.last_step),
                None)


def decide(finding: Finding, on_divergence: str, verified_steps: Iterable[int],
           rollbacks: Sequence[Rollback] = ()) -> HealthAction:
    """The action for a loss or grad-norm finding under health.on_divergence. Warn-only kinds (spikes,
    progress_unreadable, and any kind this module does not own) warn."""
    what = f"{finding.kind}: {finding.message}"
    if finding.kind not in DIVERGENCE_KINDS or on_divergence == "warn":
        return HealthAction("warn", what)
    if on_divergence == "stop":
        return HealthAction("stop", f"{what}; stopping (health.on_divergence = \"stop\"), checkpoints kept")
    again = recurrence(finding, rollbacks)
    if again is not None:
        return HealthAction("stop", f"{what}; the same symptom again within steps {again.to_step + 1}-"
                                    f"{again.last_step} after rolling back to checkpoint-{again.to_step}: the data "
                                    "order is deterministic, so it is likely data-caused; stopping")
    onset = finding.first_step if finding.first_step is not None else finding.last_step or 0
    target = newest_before(onset, verified_steps)
    if target is None:
        return HealthAction("stop", f"{what}; no verified checkpoint before the onset at step {onset} to roll back "
                                    "to; stopping")
    return HealthAction("rollback", f"{what}; rolling back to checkpoint-{target} (checkpoints from step {onset} "
                                    "on are quarantined)", relaunch_from=target, quarantine_from=onset)


def decide_resume(finding: Finding, resumed_from: int, verified_steps: Iterable[int],
                  retrying: bool) -> HealthAction:
    """The action for a resume_divergence of an attempt resumed from checkpoint `resumed_from`. `retrying`: that
    attempt is itself the relaunch from the checkpoint before a suspect one."""
    what = f"{HealthKind.RESUME_DIVERGENCE}: {finding.message}"
    if retrying:
        return HealthAction("stop", f"{what}; the relaunch from checkpoint-{resumed_from}, before the suspect "
                                    "checkpoint, diverged too: the resume path itself is broken, not the "
                                    "checkpoint; stopping")
    target = newest_before(resumed_from, verified_steps)
    if target is None:
        return HealthAction("stop", f"{what}; checkpoint-{resumed_from} is suspect and no verified checkpoint "
                                    "precedes it; stopping")
    return HealthAction("rollback", f"{what}; checkpoint-{resumed_from} is quarantined as suspect, relaunching "
                                    f"once from checkpoint-{target}",
                        relaunch_from=target, quarantine_from=resumed_from)


def slowdown_action(on_slowdown: str, now: float, last_restart_at: float | None,
                    min_gap_s: float = RESTART_MIN_GAP_S) -> HealthAction:
    """The action at a `throughput_drop` under health.on_slowdown (the schema allows "warn" and "restart"):
    "restart" at most once per `min_gap_s`; otherwise, and for "warn", warn. The reason says why."""
    if on_slowdown != "restart":
        return HealthAction("warn", 'health.on_slowdown = "warn"')
    if last_restart_at is not None and now - last_restart_at < min_gap_s:
        return HealthAction("warn", f"restarted for a slowdown {now - last_restart_at:.0f} s ago; at most one "
                                    f"restart per {min_gap_s:.0f} s")
    return HealthAction("restart", "health.on_slowdown = \"restart\"")


@dataclass(frozen=True)
class Situation:
    """What deciding a pass's findings needs besides them: the recipe's choices, the verified checkpoints, the
    run's earlier rollbacks, the attempt's resume point, and the clock for on_slowdown."""

    on_divergence: str = "stop"
    on_slowdown: str = "warn"
    verified_steps: Sequence[int] = ()
    rollbacks: Sequence[Rollback] = ()
    resumed_from: int | None = None        # the checkpoint step the attempt resumed from (None: from scratch)
    retrying_resume: bool = False          # the attempt is the relaunch before a suspect resume checkpoint
    now: float = 0.0
    last_restart_at: float | None = None


def act(finding: Finding, situation: Situation) -> HealthAction:
    """The action for any finding: what KINDS declares for its kind, decided under `situation`."""
    s = situation
    match KINDS[HealthKind(finding.kind)].act:
        case "on_divergence":
            return decide(finding, s.on_divergence, s.verified_steps, s.rollbacks)
        case "resume" if s.resumed_from is not None:
            return decide_resume(finding, s.resumed_from, s.verified_steps, s.retrying_resume)
        case "on_slowdown":
            return slowdown_action(s.on_slowdown, s.now, s.last_restart_at)
    return HealthAction("warn", finding.message)
