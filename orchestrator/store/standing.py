"""The one owner of a checkpoint's standing (types.Standing), and of the requests that set checkpoints aside.

    written -> verified -> healthy -> published        (a new save of the same step starts again at written)
       \\-> invalid            any -> set_aside(reason)

Sync publishes, resume_point() returns, retention keeps as good and the export merges only `usable` checkpoints
(healthy or published). A manifest proves bytes, not health: only the content check (store/checkpoint_health.py)
makes a checkpoint healthy. Every change goes through Standings.move, which checks types.STANDING_TRANSITIONS
and records it in the journal's checkpoints table, so a restarted supervisor keeps what it knew. The loop's
thread changes standing; the sync thread only asks (`publish_refusal`), under the lock.

A set-aside is a request first (SetAside, persisted in the journal's kv `set_aside_pending` before anything
moves), then moves: the standing of every checkpoint it names is set_aside at once (no round publishes it, no
resume takes it), and its local and published copies are renamed by whoever can (RunContext.apply_set_asides),
retried until both are done; only then is the request, and a NaN's `nan_pending`, cleared.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace

from orchestrator.host.journal import Journal
from orchestrator.types import STANDING_TRANSITIONS, USABLE, SetAsideReason, Standing

PENDING_KEY = "set_aside_pending"


class StandingError(RuntimeError):
    """A standing change types.STANDING_TRANSITIONS does not allow: a bug."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint step's standing, the directory it is about and the save it judged (newest file time)."""

    step: int
    path: str
    standing: Standing
    reason: SetAsideReason | None = None
    saved_at: float | None = None


@dataclass(frozen=True)
class SetAside:
    """A durable request to move checkpoints out of the resume path: from `from_step` on (a NaN, a divergence's
    onset, a suspect resume point), or only that step (`only_step`: a content finding). The local copies move
    first; `through_step` is then fixed (the newest step they reached: a relaunch's later saves are not the
    request's) and the published copies in [from_step, through_step] move next. The request is cleared when
    both have moved."""

    from_step: int
    reason: SetAsideReason
    attempt: int
    cause: str
    only_step: bool = False
    local_done: bool = False
    published_done: bool = False
    through_step: int | None = None

    def covers(self, step: int) -> bool:
        """Tells whether checkpoint `step` is one this request sets aside."""
        if self.only_step:
            return step == self.from_step
        return step >= self.from_step and (self.through_step is None or step <= self.through_step)

    def to_json(self) -> dict:
        return asdict(self) | {"reason": self.reason.value}

    @classmethod
    def from_json(cls, d: dict) -> SetAside:
        return cls(**(d | {"reason": SetAsideReason(d["reason"])}))


class Standings:
    """Every checkpoint step's standing (loaded from the journal, changed only by `move`) and the pending
    set-aside requests."""

    def __init__(self, journal: Journal | None) -> None:
        """Loads what `journal` recorded (None: nothing is loaded or recorded: a tool's throwaway view)."""
        self.journal = journal
        self.lock = threading.Lock()   # entries and pending: the sync thread reads while the loop's thread moves
        self.entries: dict[int, Entry] = {}
        for row in journal.checkpoints() if journal is not None else ():
            if row.get("standing"):
                why = row.get("reason")
                self.entries[row["step"]] = Entry(row["step"], row["path"], Standing(row["standing"]),
                                                  SetAsideReason(why) if why else None, row.get("saved_at"))
        kv = journal.get_all() if journal is not None else {}
        self.pending = [SetAside.from_json(d) for d in kv.get(PENDING_KEY) or ()]

    # ---- reading (any thread) ----------------------------------------------------------------------------
    def of(self, step: int) -> Entry | None:
        with self.lock:
            return self.entries.get(step)

    def usable(self, step: int, path: str | None = None) -> bool:
        """Tells whether checkpoint `step` (at `path`, when given) may be resumed from, kept as good or exported."""
        e = self.of(step)
        return e is not None and e.standing in USABLE and (path is None or e.path == path)

    def publish_refusal(self, step: int, path: str) -> str | None:
        """Why checkpoint `step` at `path` may not be published now; None when it may (the sync round's gate)."""
        e = self.of(step)
        if (req := self.covering(step, local=False)) is not None:
            return (f"checkpoint-{step}: the published copies from checkpoint-{req.from_step} are being set aside "
                    f"({req.reason.value}); published once they are")
        if e is not None and e.path == path and e.standing in USABLE:
            return None
        if e is None or e.path != path or e.standing in (Standing.WRITTEN, Standing.VERIFIED):
            return f"checkpoint-{step}: its content check is not done yet; published once it is healthy"
        why = f" ({e.reason.value})" if e.reason else ""
        return f"checkpoint-{step}: standing {e.standing.value}{why}; never published"

    def steps(self, *standings: Standing) -> list[int]:
        """The steps in one of `standings`, oldest first."""
        with self.lock:
            return sorted(s for s, e in self.entries.items() if e.standing in standings)

    # ---- changing (the loop's thread) --------------------------------------------------------------------
    def move(self, step: int, path: str, to: Standing, reason: SetAsideReason | None = None,
             saved_at: float | None = None) -> Entry:
        """Changes checkpoint `step`'s standing to `to`, checked against types.STANDING_TRANSITIONS (WRITTEN, a new
        save of the step, is allowed from any standing), and records it. A move to where it stands is a no-op."""
        with self.lock:
            e = self.entries.get(step)
            if e is not None and e.standing is to and e.path == path and to is not Standing.WRITTEN:
                return e
            if to is not Standing.WRITTEN and (e is None or to not in STANDING_TRANSITIONS[e.standing]):
                raise StandingError(f"checkpoint-{step}: {e.standing.value if e else 'unknown'} -> {to.value} "
                                    "is not in types.STANDING_TRANSITIONS")
            new = Entry(step, path, to, reason, saved_at if saved_at is not None else e.saved_at if e else None)
            self.entries[step] = new
        if self.journal is not None:
            self.journal.record_standing(step, path, to.value, reason.value if reason else None, new.saved_at)
        return new

    def request(self, req: SetAside) -> SetAside:
        """Records a set-aside request (durably, first) and sets aside every known checkpoint it covers; the same
        request again is a no-op. Returns the request kept."""
        if (same := self.current(req)) is not None:
            return same
        with self.lock:
            self.pending.append(req)
        self._save()
        for step in self.steps(*(s for s in Standing if s is not Standing.SET_ASIDE)):
            if req.covers(step):
                self.move(step, self.entries[step].path, Standing.SET_ASIDE, req.reason)
        return req

    def set_aside_known(self, step: int, path: str, reason: SetAsideReason) -> None:
        """Sets aside a checkpoint a pending request covers that appeared after the request was made."""
        e = self.of(step)
        if e is None:  # never scanned (a save on the way out of the attempt): a new save first
            self.move(step, path, Standing.WRITTEN)
        if e is None or e.standing is not Standing.SET_ASIDE:
            self.move(step, path, Standing.SET_ASIDE, reason)

    def current(self, req: SetAside) -> SetAside | None:
        """The pending request `req` is (as it stands now), or None once it was cleared."""
        key = (req.from_step, req.reason, req.only_step)
        with self.lock:
            return next((p for p in self.pending if (p.from_step, p.reason, p.only_step) == key), None)

    def covering(self, step: int, local: bool = True) -> SetAside | None:
        """The pending request whose `local` (else published) part still has to move checkpoint `step`."""
        with self.lock:
            return next((p for p in self.pending
                         if p.covers(step) and not (p.local_done if local else p.published_done)), None)

    def progressed(self, req: SetAside, local_through: int | None = None, published: bool = False) -> SetAside | None:
        """Records that a request's local copies have moved (`local_through`: the newest step they reached) and/or
        its published ones; returns it as it stands now, or None once both have (it is then cleared)."""
        now = req
        if local_through is not None and not req.local_done:
            now = replace(now, local_done=True,
                          through_step=req.from_step if req.only_step else max(req.from_step, local_through))
        if published:
            now = replace(now, published_done=True)
        done = now.local_done and now.published_done
        if now != req or done:
            with self.lock:
                i = self.pending.index(req)
                if done:
                    del self.pending[i]
                else:
                    self.pending[i] = now
            self._save()
        return None if done else now

    def _save(self) -> None:
        if self.journal is not None:
            with self.lock:
                pending = [p.to_json() for p in self.pending]
            self.journal.put(**{PENDING_KEY: pending})
