"""Goodput accounting: table-driven cases over attempts and recorded spans."""
from __future__ import annotations

import math

import pytest

from orchestrator.domain.goodput import LOST_CAUSES, AttemptTimes, Span, account, attempt_spans, summarize

A = AttemptTimes


def lost(**kw: float) -> dict[str, float]:
    out = dict.fromkeys(LOST_CAUSES, 0.0)
    out.update(kw)
    return out


# (id, attempts, extra spans, now, window start, productive, lost by cause)
CASES = [
    ("running, after startup", [A(0, first_step_at=100)], [], 1000, None, 900, lost(startup=100)),
    ("completed: nothing lost", [A(0, 1000, first_step_at=100, last_checkpoint_at=400, completed=True)],
     [], 1000, None, 900, lost(startup=100)),
    ("crash after a checkpoint: work since it is redone",
     [A(0, 800, first_step_at=100, last_checkpoint_at=600)], [], 800, None, 500,
     lost(startup=100, lost_progress=200)),
    ("crash without any checkpoint of its own", [A(0, 800, first_step_at=100)], [], 800, None, 0,
     lost(startup=100, lost_progress=700)),
    ("resumed from a checkpoint older than the attempt: all of it lost",
     [A(0, 800, first_step_at=100, last_checkpoint_at=-50)], [], 800, None, 0,
     lost(startup=100, lost_progress=700)),
    ("checkpoint time after the end is clamped", [A(0, 800, first_step_at=100, last_checkpoint_at=900)],
     [], 800, None, 700, lost(startup=100)),
    ("crash before the first step: all startup", [A(0, 300)], [], 300, None, 0, lost(startup=300)),
    ("still starting up", [A(0)], [], 250, None, 0, lost(startup=250)),
    ("hang: last step -> detection is hang, detection -> exit is cleanup",
     [A(0, 1030, first_step_at=100, last_step_at=700, last_checkpoint_at=500, hang_detected_at=1000)],
     [], 1030, None, 400, lost(startup=100, lost_progress=200, hang=300, cleanup=30)),
    ("hang with no last step known: no hang time, progress lost up to detection",
     [A(0, 1030, first_step_at=100, hang_detected_at=1000)], [], 1030, None, 0,
     lost(startup=100, lost_progress=900, cleanup=30)),
    ("stopped by the operator: work after the checkpoint is redone like after a crash",
     [A(0, 1000, first_step_at=100, last_checkpoint_at=900)], [], 1000, None, 800,
     lost(startup=100, lost_progress=100)),
    ("crash, cleanup, wait, verify, relaunch",
     [A(0, 1000, first_step_at=100, last_checkpoint_at=600), A(1200, first_step_at=1300)],
     [Span(1000, 1060, "cleanup"), Span(1060, 1150, "wait"), Span(1150, 1200, "verify")],
     2000, None, 1200, lost(startup=200, lost_progress=400, cleanup=110, wait=90)),
    ("crash-loop backoff counts as wait", [A(0, 100), A(400, first_step_at=500)],
     [Span(100, 400, "backoff")], 600, None, 100, lost(startup=200, wait=300)),
    ("uncovered gap (supervisor down) is other", [A(0, 500), A(700, first_step_at=800)], [],
     1000, None, 200, lost(startup=600, other=200)),
    ("window start cuts earlier time off", [A(0, 1000, first_step_at=100, completed=True)], [],
     1000, 500, 500, lost()),
    ("window start before the first launch is other", [A(100, first_step_at=100)], [], 200, 0, 100,
     lost(other=100)),
    ("overlapping spans are not counted twice", [],
     [Span(0, 100, "productive"), Span(50, 150, "wait")], 150, None, 100, lost(wait=50)),
    ("nothing recorded", [], [], 1000, None, 0, lost()),
    # slow: throughput_drop -> throughput_recovered (or the attempt's end), recorded as a "slow" span
    ("slow stretch of a running attempt: out of productive", [A(0, first_step_at=100)],
     [Span(300, 500, "slow")], 1000, None, 700, lost(startup=100, slow=200)),
    ("slow until a completed end", [A(0, 1000, first_step_at=100, completed=True)],
     [Span(600, 1000, "slow")], 1000, None, 500, lost(startup=100, slow=400)),
    ("slow after the kept checkpoint of a crashed attempt: lost_progress only, not twice",
     [A(0, 800, first_step_at=100, last_checkpoint_at=600)], [Span(500, 800, "slow")], 800, None, 400,
     lost(startup=100, lost_progress=200, slow=100)),
    ("slow spans overlapping each other count once", [A(0, first_step_at=100)],
     [Span(200, 400, "slow"), Span(300, 500, "slow")], 1000, None, 600, lost(startup=100, slow=300)),
    ("slow span reaching into startup and a wait: only its training counts",
     [A(0, 1000, first_step_at=100, last_checkpoint_at=1000), A(1100, first_step_at=1200)],
     [Span(1000, 1100, "wait"), Span(50, 150, "slow"), Span(900, 1300, "slow")], 1500, None, 950,
     lost(startup=200, wait=100, slow=250)),
    ("slow span cut by the window", [A(0, first_step_at=0)], [Span(0, 600, "slow")], 1000, 400, 400,
     lost(slow=200)),
]


@pytest.mark.parametrize("attempts,spans,now,start,productive,expected",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_account(attempts, spans, now, start, productive, expected):
    g = account(attempts, spans, now=now, start=start)
    assert g.productive_s == pytest.approx(productive)
    assert g.lost == pytest.approx(expected)
    assert set(g.lost) == set(LOST_CAUSES)
    # Every second of the window is charged exactly once.
    assert g.productive_s + g.badput_s == pytest.approx(g.total_s)
    assert g.ratio == pytest.approx(productive / g.total_s if g.total_s else 0.0)
    assert 0.0 <= g.ratio <= 1.0


def test_ratio_of_an_empty_window_is_zero():
    g = summarize([], 10.0, 10.0)
    assert g.total_s == 0 and g.ratio == 0.0 and not math.isnan(g.ratio)


def test_end_bounds_the_window():
    g = account([A(0, first_step_at=100)], now=5000, end=1000)
    assert (g.total_s, g.productive_s) == (1000, 900)


@pytest.mark.parametrize("kind", ["productive", "startup", "lost_progress", "wait", "backoff", "hang",
                                  "cleanup", "verify"])
def test_known_span_kinds(kind):
    assert Span(0, 1, kind).seconds == 1


def test_unknown_span_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown span kind"):
        Span(0, 1, "coffee")


def test_attempt_spans_are_ordered_and_positive():
    spans = attempt_spans(A(0, 1030, first_step_at=100, last_step_at=700, last_checkpoint_at=500,
                            hang_detected_at=1000), now=2000)
    assert [s.kind for s in spans] == ["startup", "hang", "cleanup", "productive", "lost_progress"]
    assert all(s.seconds > 0 for s in spans)


def test_running_attempt_loses_nothing_yet():
    # Work since the last checkpoint is at risk but not lost until the attempt ends.
    g = account([A(0, first_step_at=100, last_checkpoint_at=200)], now=1000)
    assert g.lost["lost_progress"] == 0 and g.productive_s == 900


# ------------------------------------------------------------------------------------------ from the journal

T = 1_800_000_000.0


def crashed_and_resumed(tmp_path, *, saved_at: bool = True):
    """The demo's crash in a journal: attempt 1 trains from T+10, saves checkpoint-10 at T+14 and
    checkpoint-20 at T+19 and is SIGKILLed at T+20.5 (step 26); the scan verifies both only after the
    exit. Attempt 2 resumes from checkpoint-20 and completes."""
    from orchestrator.host.journal import Journal
    from orchestrator.types import Attempt, CrashClass

    j = Journal(tmp_path / "journal.sqlite")
    j.record_attempt(Attempt(1, T, ended_at=T + 20.5, cls=CrashClass.HOST_OOM_KILLED, start_step=0, end_step=26,
                             first_step_at=T + 10, last_step_at=T + 20.4))
    j.record_attempt(Attempt(2, T + 21.5, ended_at=T + 40, start_step=20, end_step=40,
                             first_step_at=T + 31.5, last_step_at=T + 40))
    for step, saved, verified in ((10, T + 14, T + 20.52), (20, T + 19, T + 20.53), (30, T + 35, T + 35.1)):
        j.record_checkpoint(step, f"/out/checkpoint-{step}", True, saved_at=saved if saved_at else None)
        j.db.execute("UPDATE checkpoints SET verified_at = ? WHERE step = ?", (verified, step))
    j.put(state="completed", updated_at=T + 41)
    return j


def test_work_after_the_kept_checkpoint_is_lost_from_its_save_time(tmp_path):
    from orchestrator.host.journal_goodput import goodput_of

    j = crashed_and_resumed(tmp_path)
    g = goodput_of(j, now=T + 100)
    # steps 21-26 (T+19 -> T+20.5) are redone; not the 0.03 s between the late verification and the exit
    assert g.lost["lost_progress"] == pytest.approx(1.5)
    assert g.productive_s == pytest.approx((19 - 10) + (40 - 31.5))
    assert g.total_s == pytest.approx(40), "a completed run's window ends when its work ended"
    assert g.productive_s + g.badput_s == pytest.approx(g.total_s)


def test_a_journal_without_saved_at_falls_back_to_the_verification_time(tmp_path):
    from orchestrator.host.journal_goodput import goodput_of

    j = crashed_and_resumed(tmp_path, saved_at=False)
    # all it can say: checkpoint-20 was verified after the exit, so nothing after it is known to be lost
    assert goodput_of(j, now=T + 100).lost["lost_progress"] == 0.0


def test_an_old_journal_gains_the_saved_at_column(tmp_path):
    import sqlite3

    from orchestrator.host.journal import SCHEMA, Journal

    path = tmp_path / "journal.sqlite"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA.replace(", saved_at REAL", ""))
    db.execute("INSERT INTO checkpoints (step, path, ok, verified_at) VALUES (10, '/out/checkpoint-10', 1, 5.0)")
    db.commit()
    db.close()
    j = Journal(path)
    j.record_checkpoint(20, "/out/checkpoint-20", True, saved_at=7.0)
    assert [(c["step"], c["saved_at"]) for c in j.checkpoints()] == [(10, None), (20, 7.0)]


@pytest.mark.parametrize("state, updated_at, end", [
    ("completed", T + 90_000, T + 40),   # `orchestrator run` again a day later: nothing launched, no idle
    ("stopped", T + 45, T + 45),         # a stopped run: up to its last update
    ("running", T + 41, T + 50),         # live: up to now
])
def test_window_end(state, updated_at, end):
    from orchestrator.domain.goodput import Span, window_end
    from orchestrator.types import Attempt

    attempts = [Attempt(1, T, ended_at=T + 20), Attempt(2, T + 21, ended_at=T + 38)]
    assert window_end({"state": state, "updated_at": updated_at}, attempts, [Span(T + 38, T + 40, "cleanup")],
                      T + 50) == end


def test_running_a_completed_run_again_adds_no_idle_time(tmp_path):
    """`orchestrator run` on a run that completed a day ago launches nothing; its goodput is unchanged."""
    import time

    from orchestrator.host.journal_goodput import goodput_of
    from orchestrator.config.recipe import load
    from orchestrator.loop.supervisor import Supervisor
    from supervised import fake_recipe, journal, supervise

    recipe = fake_recipe(tmp_path, iterations=20)
    code, _ = supervise(recipe)
    assert code == 0
    j = journal(tmp_path / "out")
    before = goodput_of(j)
    j.close()
    from orchestrator.host.gpu import NullReader
    from orchestrator.host.base import LocalHost

    class DayLater(LocalHost):
        def now(self) -> float:
            return time.time() + 86_400

    day_later = Supervisor(load(recipe), host=DayLater(NullReader()), install_signals=False)
    assert day_later.run() == 0
    j = journal(tmp_path / "out")
    try:
        assert j.get_all()["updated_at"] > time.time() + 80_000, "the second session did record its time"
        assert len(j.attempts()) == 1
        after = goodput_of(j)
    finally:
        j.close()
    assert after.total_s == pytest.approx(before.total_s)
    assert after.lost == pytest.approx(before.lost)
