"""Runs sharing one persistent_dir never overwrite, prune or restore each other's published checkpoints
(issue 10): the publish dir per run name and recipe hash, the manifest hash on every path, the publisher
lock, the flat layout of earlier releases, and what status/history say about sync."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoint_dirs import make_swift

from orchestrator.store import manifest as mf
from orchestrator.store import published as pb
from orchestrator.store import sync
from orchestrator.config.recipe import RecipeError, load, recipe_hash
from orchestrator.types import ExitCode
from isolation_check import assert_copies_are_the_runs, snapshot
from supervised import attempts, cli, events, fake_recipe, journal, logged_steps, published_at, supervise, wait_for

LR_B = "optim.lr=2e-4"


# ------------------------------------------------------------------------------------------ pure parts

@pytest.mark.parametrize("manifest,h,mine", [
    ({"recipe_hash": "aa", "files": []}, "aa", True),
    ({"recipe_hash": "bb", "files": []}, "aa", False),
    ({"files": []}, "aa", False),
    (None, "aa", False),
])
def test_owned_table(manifest, h, mine):
    assert pb.owned(manifest, h) is mine


def test_publish_dir_is_run_name_and_hash8(tmp_path):
    assert pb.publish_dir(tmp_path, "demo", "0123456789abcdef") == tmp_path / "demo-01234567"


# ------------------------------------------------------------------------------------------ sync.py paths

def test_sync_never_overwrites_or_prunes_a_copy_of_another_hash(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    foreign = tmp_path / "other"
    make_swift(foreign, 5)
    assert sync.sync_once(foreign, pers, "swift", "other-hash").ok
    make_swift(foreign, 10, loss=0.1)
    assert sync.sync_once(foreign, pers, "swift", "other-hash").ok
    before = snapshot(pers / "checkpoint-10") | {"5": snapshot(pers / "checkpoint-5")}
    rounds = []
    for s in (10, 20, 30, 40):  # a round after each save
        make_swift(out, s)
        rounds.append(sync.sync_once(out, pers, "swift", "mine", keep=5))
    assert [p for p in rounds[0].problems if "not this run's copy" in p] == [
        sync.foreign_problem(pers / "checkpoint-10", mf.read_manifest(pers / "checkpoint-10"), "mine")]
    assert not rounds[0].synced and [r.copied for r in rounds] == [(), ("checkpoint-20",), ("checkpoint-30",),
                                                                    ("checkpoint-40",)]
    r = sync.sync_once(out, pers, "swift", "mine", keep=1)  # prunes its own copies down to one
    assert set(r.deleted) == {"checkpoint-20", "checkpoint-30"}, "another run's old steps are not this run's to prune"
    assert snapshot(pers / "checkpoint-10") | {"5": snapshot(pers / "checkpoint-5")} == before
    with pytest.raises(sync.SyncError, match="another run's copy"):
        sync.restore(pers, tmp_path / "fresh", 10, recipe_hash="mine")


def test_local_checkpoint_of_another_hash_is_not_published(tmp_path):
    out, pers = tmp_path / "out", tmp_path / "pers"
    mf.write_manifest(make_swift(out, 10), 10, "old")  # saved before run.on_drift = "resume" changed the recipe
    r = sync.sync_once(out, pers, "swift", "new")
    assert r.copied == () and any("checkpoint-10: its manifest names recipe old" in s for s in r.skipped)
    make_swift(out, 20)
    assert sync.sync_once(out, pers, "swift", "new").copied == ("checkpoint-20",)


# ------------------------------------------------------------------------------------------ the publisher lock

def test_second_publisher_of_the_same_place_is_refused_naming_the_first(tmp_path):
    a = pb.PublishLock(tmp_path / "p", "t", "h" * 64, tmp_path / "out-a")
    a.acquire()
    try:
        b = pb.PublishLock(tmp_path / "p", "t", "h" * 64, tmp_path / "out-b")
        with pytest.raises(RecipeError, match=rf"pid {os.getpid()}.*out-a"):
            b.acquire()
        with pytest.raises(RecipeError, match=rf"pid {os.getpid()}\) publishes run t "):
            b.check_for_sync()  # a `sync --once` from another output dir
        pb.PublishLock(tmp_path / "p", "t", "h" * 64, tmp_path / "out-a").check_for_sync()  # its own: runs
        pb.PublishLock(tmp_path / "p", "t", "g" * 64, tmp_path / "out-b").acquire()  # another hash: another place
    finally:
        a.release()
    b.acquire()  # free once the first is gone
    b.release()


def test_supervisor_publishing_into_a_taken_place_exits_2_before_launching(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=4000, extra_env={"FAKE_STEP_S": "0.02"}, state=False)
    a = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for((tmp_path / "out" / "logging.jsonl").exists, 60), "run A never launched"
        other = tmp_path / "out-elsewhere"
        r = cli("run", str(recipe), "--set", f"run.output_dir={json.dumps(str(other))}")
        assert r.returncode == ExitCode.BAD_INPUT, r.stderr
        assert f"pid {a.pid}) publishes run t " in r.stderr and str(tmp_path / "out") in r.stderr
        assert attempts(other) == [], "nothing launched"
        s = cli("sync", str(recipe), "--once", "--set", f"run.output_dir={json.dumps(str(other))}")
        assert s.returncode == ExitCode.BAD_INPUT and f"pid {a.pid}" in s.stderr
        s = cli("sync", str(recipe), "--once", "--json")  # run A's own output dir: allowed beside its supervisor
        assert s.returncode in (0, 1) and json.loads(s.stdout)["destination"] == str(published_at(recipe))
    finally:
        a.terminate()
        a.communicate(timeout=60)
    assert a.returncode == 0


# ------------------------------------------------------------------------------------------ two runs, one persistent_dir

def test_two_runs_one_after_the_other_keep_their_own_copies(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=40, state=False)
    assert supervise(recipe)[0] == ExitCode.OK
    pub_a, h_a = published_at(recipe), recipe_hash(load(recipe))
    names_a = assert_copies_are_the_runs(pub_a, tmp_path / "out", h_a)
    before = snapshot(pub_a)
    code, sup_b = supervise(recipe, LR_B)  # drift: a fresh output dir, its own publish dir
    assert code == ExitCode.OK
    pub_b = published_at(recipe, LR_B)
    assert pub_b != pub_a and sup_b.ctx.out != tmp_path / "out"
    names_b = assert_copies_are_the_runs(pub_b, sup_b.ctx.out, sup_b.hash)
    # each published its final checkpoint; which earlier ones a round reached before the next save superseded them
    # depends on timing (a round publishes only the newest healthy one)
    assert names_a[-1] == names_b[-1] == "checkpoint-40"
    assert snapshot(pub_a) == before, "run B touched run A's copies"
    r = cli("sync", str(recipe), "--once", "--json")  # A's sync after B: copies nothing, touches nothing of B's
    assert r.returncode == 0 and json.loads(r.stdout)["copied"] == 0, r.stderr
    b_before = snapshot(pub_b)
    r = cli("sync", str(recipe), "--once", "--set", LR_B, "--json")  # B's own sync finds B's drifted output dir
    assert r.returncode == 0 and json.loads(r.stdout)["output_dir"] == str(sup_b.ctx.out), r.stdout + r.stderr
    assert snapshot(pub_b) == b_before and snapshot(pub_a) == before


def test_two_runs_at_the_same_time_keep_their_own_copies(tmp_path):
    # 20 s of training: B's start (a Python process, seconds on a loaded machine) falls inside A's run.
    recipe = fake_recipe(tmp_path, iterations=200, extra_env={"FAKE_STEP_S": "0.1"}, state=False)
    run = [sys.executable, "-m", "orchestrator", "run", str(recipe)]
    a = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: (published_at(recipe) / "checkpoint-10").is_dir() or a.poll() is not None, 60)
    b = subprocess.Popen([*run, "--set", LR_B], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err_a = a.communicate(timeout=120)
    _, err_b = b.communicate(timeout=120)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    h_b = recipe_hash(load(recipe, [LR_B]))
    out_b = tmp_path / f"out-{h_b[:8]}"
    assert logged_steps(tmp_path / "out")[-1] == 200 and logged_steps(out_b)[-1] == 200
    assert attempts(out_b)[0].started_at < attempts(tmp_path / "out")[-1].ended_at, "the two trainings overlapped"
    names_a = assert_copies_are_the_runs(published_at(recipe), tmp_path / "out", recipe_hash(load(recipe)))
    names_b = assert_copies_are_the_runs(published_at(recipe, LR_B), out_b, h_b)
    assert "checkpoint-200" in names_a and "checkpoint-200" in names_b
    assert not pb.copies_in(tmp_path / "persist"), "nothing in the flat layout"


# ------------------------------------------------------------------------------------------ restore, upgrade

def test_restore_takes_only_this_hash_and_finds_the_flat_layout_of_an_earlier_release(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=40, state=False)
    assert supervise(recipe)[0] == ExitCode.OK
    pers, pub = tmp_path / "persist", published_at(recipe)
    for n in pb.copies_in(pub):  # what today's release wrote: <persistent_dir>/checkpoint-N
        os.rename(pub / n, pers / n)
    shutil.rmtree(pub)
    newer = pers / "checkpoint-50"  # another recipe's newer copy, same flat directory
    shutil.copytree(pers / "checkpoint-40", newer)
    m = mf.read_manifest(newer)
    mf.write_json_atomic(newer / mf.MANIFEST, dict(m, recipe_hash="f" * 64, step=50))
    shutil.rmtree(tmp_path / "out")  # a new machine: empty local disk
    code, sup = supervise(recipe, "optim.iterations=40")
    assert code == ExitCode.OK
    assert attempts(tmp_path / "out")[0].resumed_from == str(tmp_path / "out" / "checkpoint-40")
    restored = events(tmp_path / "out", "restored")
    assert len(restored) == 1 and "flat layout" in restored[0]["message"]
    assert restored[0]["data"]["source"] == str(pers / "checkpoint-40") and restored[0]["data"]["flat"]
    assert not (tmp_path / "out" / "checkpoint-50").exists(), "another recipe's copy was restored"
    assert mf.read_manifest(newer)["recipe_hash"] == "f" * 64, "left alone"


def test_restore_prefers_the_publish_dir_and_says_which_copy_it_took(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=30, state=False)
    assert supervise(recipe)[0] == ExitCode.OK
    assert supervise(recipe, LR_B)[0] == ExitCode.OK  # another hash publishes the same steps
    shutil.rmtree(tmp_path / "out")
    assert supervise(recipe)[0] == ExitCode.OK
    restored = events(tmp_path / "out", "restored")
    assert restored[0]["data"]["source"] == str(published_at(recipe) / "checkpoint-30")
    assert recipe_hash(load(recipe))[:8] in restored[0]["message"] and not restored[0]["data"]["flat"]


# ------------------------------------------------------------------------------------------ status / history

def test_status_and_history_report_only_the_runs_own_copies(tmp_path):
    from orchestrator.ops import report

    recipe = fake_recipe(tmp_path, iterations=30, state=False)
    assert supervise(recipe)[0] == ExitCode.OK
    code, sup_b = supervise(recipe, LR_B)
    assert code == ExitCode.OK
    r = load(recipe)
    j = journal(tmp_path / "out")
    try:
        s = report.status_data(r, j)
        assert s["sync"]["destination"] == str(published_at(recipe)) and s["sync"]["last_synced_step"] == 30
        assert s["last_checkpoint"]["synced"]
        shutil.rmtree(published_at(recipe))  # A's copies are gone; B's checkpoint-30 must not stand in for them
        s = report.status_data(r, j)
        assert s["sync"]["last_synced_step"] is None and s["sync"]["lag_steps"] == 30
        assert not s["last_checkpoint"]["synced"]
        h = report.history_data(r, j)
        assert h["sync"]["last_synced_step"] is None
        assert f"sync: last synced step - in {published_at(recipe)}, 30 steps behind" in report.history_table(h)
    finally:
        j.close()
    hb = cli("history", str(recipe), "--set", LR_B)
    assert hb.returncode == 0 and f"last synced step 30 in {published_at(recipe, LR_B)}" in hb.stdout


def test_published_copies_from_a_nan_on_are_quarantined_and_never_restored(tmp_path):
    """A checkpoint saved after a NaN may be published before the NaN is seen: quarantine renames the published
    copy too, so a restore on a new machine never takes it."""
    from orchestrator.host.journal import Journal, journal_path
    from orchestrator.host.metrics import Metrics
    from orchestrator.store.publisher import Publisher
    from orchestrator.store.rundir import state_dir
    from orchestrator.store.standing import SetAside
    from orchestrator.types import SetAsideReason

    recipe = fake_recipe(tmp_path, iterations=30, state=False)
    assert supervise(recipe, "checkpoint.keep_local=5")[0] == ExitCode.OK
    r = load(recipe)
    for step in (10, 20):  # what rounds after each save publish (this fake run saves faster than rounds copy)
        view = tmp_path / f"view-{step}"
        shutil.copytree(tmp_path / "out" / f"checkpoint-{step}", view / f"checkpoint-{step}", symlinks=True)
        sync.sync_once(view, published_at(recipe), r.run.backend, recipe_hash(r))   # or a round of the run did
    j = Journal(journal_path(state_dir(tmp_path / "out")))
    try:
        pub = Publisher(r, recipe_hash(r), j, Metrics())
        assert sorted(c.step for c in pub._published()) == [10, 20, 30]
        nan = SetAside(20, SetAsideReason.NAN, 1, "written at or after the NaN at step 20", local_done=True,
                       through_step=30)
        assert pub.set_aside_published(nan)
        assert [c.step for c in pub._published()] == [10]
        assert (published_at(recipe) / "checkpoint-20.nan-attempt-1").is_dir()
        assert (published_at(recipe) / "checkpoint-30.nan-attempt-1").is_dir(), "the data stays for a person"
        shutil.rmtree(tmp_path / "out" / "checkpoint-20")
        shutil.rmtree(tmp_path / "out" / "checkpoint-30")
        shutil.rmtree(tmp_path / "out" / "checkpoint-10")
        pub.start_restore()
        assert pub.restore_done.wait(60)
        assert pub.finish_restore().step == 10
    finally:
        j.close()
