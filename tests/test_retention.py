"""Local retention (orchestrator/domain/retention.py): a table of cases, then the same rules on real files."""
from __future__ import annotations

import pytest

from orchestrator.domain.retention import Local, plan_prune


def ck(step, ok=True, complete=True, published=True, merged=False, merged_published=None):
    return Local(step, f"checkpoint-{step}", complete, ok, published,
                 merged_path=f"checkpoint-{step}-merged" if merged else None,
                 merged_published=published if merged_published is None else merged_published)


@pytest.mark.parametrize("local, keep, persistent, keep_merged, pressure, pruned", [
    ([], 2, True, False, False, []),
    ([ck(10), ck(20), ck(30)], 2, True, False, False, ["checkpoint-10"]),
    ([ck(10), ck(20), ck(30)], 5, True, False, False, []),
    # never: one being written, the resume point, unpublished ones, failed verification
    ([ck(10), ck(20), ck(30, complete=False)], 1, True, False, False, ["checkpoint-10"]),
    ([ck(10, published=False), ck(20), ck(30)], 1, True, False, False, ["checkpoint-20"]),
    ([ck(10, ok=False), ck(20), ck(30)], 1, True, False, False, ["checkpoint-20"]),
    ([ck(10), ck(20), ck(30, published=False)], 1, True, False, False, ["checkpoint-10", "checkpoint-20"]),
    # no persistent_dir: published is never true, the newest K are all there is
    ([ck(10, published=False), ck(20, published=False), ck(30, published=False)], 2, False, False, False,
     ["checkpoint-10"]),
    # merged copies: gone once published (also the resume point's: resume never reads it), unless kept
    ([ck(10, merged=True), ck(20, merged=True)], 2, True, False, False, ["checkpoint-10-merged", "checkpoint-20-merged"]),
    ([ck(10, merged=True), ck(20, merged=True)], 2, True, True, False, []),
    ([ck(10, merged=True), ck(20, merged=True, published=False)], 1, True, False, False,
     ["checkpoint-10", "checkpoint-10-merged"]),
    # nothing published: a kept checkpoint's merged copy stays (it is the only one)
    ([ck(10, merged=True, published=False), ck(20, merged=True, published=False)], 2, False, False, False, []),
    # the final export's merged copy appears after its checkpoint was published: kept until it is published too
    ([ck(10), ck(20, merged=True, merged_published=False)], 2, True, False, False, []),
    ([ck(10), ck(20, merged=True, merged_published=False)], 2, True, False, True, ["checkpoint-10"]),
    # a pruned checkpoint's unpublished merged copy stays; a published one goes with it
    ([ck(10, merged=True, merged_published=False), ck(20)], 1, True, False, False, ["checkpoint-10"]),
    ([ck(10, merged=True, merged_published=False), ck(20)], 1, False, False, False,
     ["checkpoint-10", "checkpoint-10-merged"]),
    # pressure: keep only the resume point and the unpublished
    ([ck(10), ck(20), ck(30)], 3, True, False, True, ["checkpoint-10", "checkpoint-20"]),
    ([ck(10, published=False), ck(20), ck(30)], 3, True, False, True, ["checkpoint-20"]),
])
def test_plan_prune(local, keep, persistent, keep_merged, pressure, pruned):
    assert [p.path for p in plan_prune(local, keep, persistent, keep_merged, pressure)] == pruned


def test_superseded_unpublished_checkpoints_may_go():
    """Sync publishes only what persistent retention keeps: an older one it skipped is not waiting for a copy."""
    old = Local(10, "checkpoint-10", True, True, published=False, superseded=True)
    assert [p.path for p in plan_prune([old, ck(20), ck(30)], 1, True, False)] == ["checkpoint-10", "checkpoint-20"]
    assert "superseded" in plan_prune([old, ck(20), ck(30)], 1, True, False)[0].reason


def test_the_resume_point_is_never_pruned():
    for keep in (1, 2, 5):
        for pressure in (False, True):
            local = [ck(s, published=s % 20 == 0, merged=True) for s in range(10, 110, 10)]
            pruned = {p.path for p in plan_prune(local, keep, True, False, pressure)}
            assert "checkpoint-100" not in pruned
            assert not {f"checkpoint-{s}" for s in range(10, 110, 20)} & pruned, "unpublished ones stay"


def test_torn_checkpoints_go_only_when_no_trainer_is_writing():
    local = [ck(10), ck(20), Local(30, "checkpoint-30", False, False, False)]
    assert "checkpoint-30" not in [p.path for p in plan_prune(local, 2, True, False, writing=True)]
    assert [p.path for p in plan_prune(local, 2, True, False, writing=False)] == ["checkpoint-30"]
