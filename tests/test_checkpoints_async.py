"""--async_save: a megatron checkpoint whose args.json says async_save is complete only once last-checkpoint
(moved by the async request's finalize, after the shards are durable) points at it or a newer one, and was
moved after its iteration file; until then it is not verified, not pruned, not resumed from, not published.
Real files in ms-swift 4.6's layout (test_checkpoints.make_megatron); link times set explicitly."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recipes import write_recipe
from checkpoint_dirs import link_last, make_megatron
from orchestrator.config.recipe import load
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.store import checkpoints as ck
from orchestrator.store import manifest as mf
from orchestrator.store.tracker import CheckpointTracker

T0 = 1_700_000_000  # file times, seconds: each save's files at T0 + step, the link as each row says


def save(out: Path, step: int, async_save: bool = True) -> Path:
    """checkpoint-`step` as ms-swift writes it, the shards and iteration file there, the link not moved."""
    d = make_megatron(out, step)
    (d / "args.json").write_text(json.dumps({"async_save": async_save, "save_steps": 10}))
    for f in d.rglob("*"):
        os.utime(f, (T0 + step, T0 + step))
    return d


def move_link(out: Path, step: int, at: float) -> None:
    """What the async request's finalize does (update_last_checkpoint_symlink), at time `at`."""
    link_last(out, step)
    os.utime(out / "last-checkpoint", (at, at), follow_symlinks=False)


# (saves: (step, async) written in order; the link: (step, moved at) or None; step verified; complete)
ROWS = {
    "shards + iteration file, link still at N-1": ([(10, True), (20, True)], (10, T0 + 15), 20, False),
    "the same: N-1 is complete": ([(10, True), (20, True)], (10, T0 + 15), 10, True),
    "link moved to N": ([(10, True), (20, True)], (20, T0 + 25), 20, True),
    "link moved to a newer one": ([(10, True), (20, True), (30, True)], (30, T0 + 35), 20, True),
    "no link yet (the first save in flight)": ([(10, True)], None, 10, False),
    "a synchronous save: the iteration file marks it": ([(10, False)], None, 10, True),
    "link names N but was moved before N's iteration file (N rewritten by a relaunch)":
        ([(10, True), (20, True)], (20, T0 + 5), 20, False),
    "dangling link (N+1 quarantined), moved after N": ([(10, True), (20, True)], (30, T0 + 35), 20, True),
}


@pytest.mark.parametrize("saves,link,step,complete", ROWS.values(), ids=ROWS.keys())
def test_async_checkpoint_is_complete_once_the_link_names_it(tmp_path, saves, link, step, complete):
    out = tmp_path / "out"
    for s, a in saves:
        save(out, s, a)
    if link:
        move_link(out, *link)
    v = ck.verify(out / f"checkpoint-{step}", backend="megatron")
    assert (v.complete, v.ok) == (complete, complete), v.problems
    if not complete:
        assert "background" in v.problems[0] or "last-checkpoint" in v.problems[0], v.problems
    infos = {i.step: i for i in ck.discover(out, "megatron")}
    assert infos[step].complete is complete


def test_a_restored_copy_is_vouched_for_by_a_fresh_manifest_of_ours(tmp_path):
    """A copy restored from persistent_dir on a fresh node has no link: the manifest we wrote after
    verifying it (and nothing written since) says it is complete; a file written after it does not."""
    out = tmp_path / "out"
    d = save(out, 10)
    assert not ck.verify(d, backend="megatron").complete
    mf.write_manifest(d, 10, "hash", 1.0)
    assert ck.verify(d, backend="megatron").ok
    (d / ck.ITER_FILE).write_text("10")  # a relaunch rewriting it in place
    assert not ck.verify(d, backend="megatron").complete


@pytest.fixture
def tracked(tmp_path: Path):
    recipe = load(write_recipe(tmp_path, lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                               checkpoint={"async_save": True}))
    out = tmp_path / "out"
    out.mkdir()
    journal = Journal(tmp_path / "journal.sqlite")
    trackers = []

    def tracker() -> CheckpointTracker:  # each call: a supervisor (re)started on the same output_dir
        trackers.append(CheckpointTracker(recipe, "hash", out, journal, Metrics(), on_saved=lambda: None))
        return trackers[-1]
    yield out, journal, tracker
    for t in trackers:
        t.close()


def test_tracker_neither_verifies_prunes_nor_resumes_from_a_save_in_flight(tracked):
    out, journal, tracker = tracked
    save(out, 10)
    move_link(out, 10, T0 + 15)
    save(out, 20)  # in flight: the link still names 10
    rc = tracker()
    rc.scan(T0 + 30)
    assert rc.wait_checks(60)   # content-checked: healthy
    assert [c["step"] for c in journal.checkpoints()] == [10]
    assert rc.resume_point().step == 10
    assert rc.prune(keep=1, pressure=True, writing=True) == 0
    assert (out / "checkpoint-20").is_dir() and (out / "checkpoint-10").is_dir()
    again = tracker()  # a supervisor restarted mid-run sees the same
    again.scan(T0 + 31)
    assert again.wait_checks(60)   # content-checked: healthy
    assert again.resume_point().step == 10 and str(out / "checkpoint-20") not in again.seen
    move_link(out, 20, T0 + 40)  # the background write finished: the finalize moved the link
    again.scan(T0 + 41)
    assert again.wait_checks(60)   # content-checked: healthy
    assert again.seen.get(str(out / "checkpoint-20")) is True
    assert again.resume_point().step == 20
    assert [c["step"] for c in journal.checkpoints()] == [10, 20]


def test_a_relaunch_rewriting_a_checkpoint_waits_for_the_link_again(tracked):
    """Resumed from 10 after 20 was written (and linked) by the attempt before: the rewrite of 20 writes
    its iteration file at once; the old link still names 20 but is older, so 20 waits for the new link."""
    out, journal, tracker = tracked
    save(out, 10)
    save(out, 20)
    move_link(out, 20, T0 + 25)
    rc = tracker()
    rc.scan(T0 + 26)
    assert rc.wait_checks(60)   # content-checked: healthy
    assert rc.seen.get(str(out / "checkpoint-20")) is True
    rc.forget_after(10)
    it = out / "checkpoint-20" / ck.ITER_FILE
    it.write_text("20")
    # the rewrite is newer than our manifest of the old save (hashed, and awaited, above): as on a real disk
    later = (out / "checkpoint-20" / "orchestrator-manifest.json").stat().st_mtime + 100
    os.utime(it, (later, later))
    rc.scan(later + 1)
    assert rc.wait_checks(60)
    assert str(out / "checkpoint-20") not in rc.seen
    move_link(out, 20, later + 30)
    rc.scan(later + 31)
    assert rc.wait_checks(60)   # content-checked: healthy
    assert rc.seen.get(str(out / "checkpoint-20")) is True


def test_publishing_skips_a_save_in_flight(tmp_path):
    from orchestrator.store import sync

    out, persistent = tmp_path / "out", tmp_path / "persistent"
    persistent.mkdir()
    save(out, 10)
    move_link(out, 10, T0 + 15)
    save(out, 20)
    r = sync.sync_once(out, persistent, "megatron", "hash")
    assert r.copied == ("checkpoint-10",), r
    assert "checkpoint-20: still being written" in r.skipped
