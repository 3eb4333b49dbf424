"""store/standing.py, the one owner of a checkpoint's standing: the transition table it enforces, the set-aside
requests it keeps, what it records in the journal and reads back after a restart."""
from __future__ import annotations

import itertools

import pytest

from orchestrator.host.journal import Journal
from orchestrator.store.standing import PENDING_KEY, SetAside, StandingError, Standings
from orchestrator.types import STANDING_TRANSITIONS, USABLE, SetAsideReason, Standing

P = "/out/checkpoint-10"


def at(standings: Standings, s: Standing) -> None:
    """Walks checkpoint-10 from written to `s` along the table."""
    path = {Standing.WRITTEN: [], Standing.VERIFIED: [Standing.VERIFIED], Standing.INVALID: [Standing.INVALID],
            Standing.HEALTHY: [Standing.VERIFIED, Standing.HEALTHY],
            Standing.PUBLISHED: [Standing.VERIFIED, Standing.HEALTHY, Standing.PUBLISHED],
            Standing.SET_ASIDE: [Standing.SET_ASIDE]}[s]
    standings.move(10, P, Standing.WRITTEN, saved_at=1.0)
    for to in path:
        standings.move(10, P, to, SetAsideReason.NAN if to is Standing.SET_ASIDE else None)


@pytest.mark.parametrize("frm, to", list(itertools.product(Standing, Standing)))
def test_every_change_is_checked_against_the_table(tmp_path, frm, to):
    st = Standings(Journal(tmp_path / "j.sqlite"))
    at(st, frm)
    allowed = to is Standing.WRITTEN or to is frm or to in STANDING_TRANSITIONS[frm]
    if allowed:
        assert st.move(10, P, to, SetAsideReason.NAN if to is Standing.SET_ASIDE else None).standing is to
    else:
        with pytest.raises(StandingError, match="STANDING_TRANSITIONS"):
            st.move(10, P, to)


def test_only_healthy_and_published_are_usable_and_publishable(tmp_path):
    st = Standings(Journal(tmp_path / "j.sqlite"))
    for s in Standing:
        at(st, s)
        assert st.usable(10, P) is (s in USABLE)
        assert (st.publish_refusal(10, P) is None) is (s in USABLE)
        assert not st.usable(10, "/out/elsewhere/checkpoint-10"), "a standing is about one directory"
    assert "not done yet" in (st.publish_refusal(20, "/out/checkpoint-20") or ""), "unknown: not checked"


def test_standings_and_requests_are_read_back_from_the_journal(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    st = Standings(j)
    at(st, Standing.HEALTHY)
    st.move(20, "/out/checkpoint-20", Standing.WRITTEN, saved_at=2.0)
    st.move(20, "/out/checkpoint-20", Standing.VERIFIED)
    req = st.request(SetAside(20, SetAsideReason.NONFINITE, 0, "NaN in its adapter", only_step=True))
    assert st.of(20).standing is Standing.SET_ASIDE and st.of(20).reason is SetAsideReason.NONFINITE
    again = Standings(j)   # a restarted supervisor
    assert again.of(10).standing is Standing.HEALTHY and again.of(10).saved_at == 1.0
    assert again.of(20).standing is Standing.SET_ASIDE and again.pending == [req]
    assert j.get_all()[PENDING_KEY][0]["reason"] == "nonfinite"


def test_a_request_clears_only_when_local_and_published_copies_have_moved(tmp_path):
    st = Standings(Journal(tmp_path / "j.sqlite"))
    req = st.request(SetAside(24, SetAsideReason.NAN, 3, "the NaN at step 24"))
    assert st.request(SetAside(24, SetAsideReason.NAN, 3, "again")) is req, "the same request is kept once"
    assert req.covers(10_000), "a range covers every later step until its local copies have moved"
    assert st.covering(30) is req and st.covering(30, local=False) is req
    now = st.progressed(req, local_through=28)
    assert now is not None and now.local_done and now.through_step == 28 and st.pending == [now]
    assert not now.covers(40), "a relaunch's later saves are not the request's"
    assert st.covering(26) is None and st.covering(26, local=False) is now
    assert "being set aside" in (st.publish_refusal(26, "/out/checkpoint-26") or "")
    assert st.progressed(now, published=True) is None and st.pending == []


def test_a_checkpoint_saved_after_the_request_is_set_aside_when_it_appears(tmp_path):
    st = Standings(Journal(tmp_path / "j.sqlite"))
    at(st, Standing.HEALTHY)
    st.request(SetAside(10, SetAsideReason.DIVERGED, 1, "the onset at step 10"))
    assert st.of(10).standing is Standing.SET_ASIDE, "known ones at once"
    st.move(12, "/out/checkpoint-12", Standing.WRITTEN)
    assert st.covering(12) is not None
    st.set_aside_known(12, "/out/checkpoint-12", SetAsideReason.DIVERGED)
    assert st.of(12).standing is Standing.SET_ASIDE
