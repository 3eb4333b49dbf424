"""The run's goodput as its journal records it: the journal's attempts, checkpoints and spans handed to the pure
accounting in domain/goodput.py."""
from __future__ import annotations

import time

from orchestrator.domain.goodput import Goodput, Span, account, attempt_times, window_end
from orchestrator.host.journal import Journal
from orchestrator.types import State


def goodput_of(j: Journal, now: float | None = None) -> Goodput:
    """Computes the run's goodput from its journal, up to `now` (default: the wall clock) for a live run."""
    kv = j.get_all()
    attempts = j.attempts()
    now = now or time.time()
    spans = [Span(s, e, k) for s, e, k in j.spans()]
    end = window_end(kv, attempts, spans, now)
    done = kv.get("state") == State.COMPLETED.value
    return account(attempt_times(attempts, j.checkpoints(), done), spans, now=end)
