"""The checkpoint gate's key cells end to end (issue 31): a real `orchestrator run` process supervising the fake
trainer (tests/support/fake_trainer.py), a real persistent_dir published by real sync rounds (rsync), a real sync
lock held by another process, a real SIGKILL of the supervisor. tests/test_checkpoint_gate_matrix.py runs every
cell on the in-memory host; these are the ones a real process can get wrong on its own (signals, locks, pipes).

Each test orders its moments with handles, never sleeps: the fake trainer holds after a save until the test
creates a file (FAKE_HOLD), the test waits (bounded) on the journal, the published directory or a pipe.
"""
from __future__ import annotations

import os
import select
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from orchestrator.host.launch import local
from orchestrator.store.checkpoint_health import scan_safetensors
from orchestrator.store.manifest import MANIFEST
from orchestrator.store.rundir import run_id
from orchestrator.store.sync import LOCK
from orchestrator.types import CrashClass, ExitCode
from supervised import attempts, events, fake_recipe, journal, published_at, wait_for

pytestmark = pytest.mark.e2e

# a held trainer is silent for seconds: no hang (the adaptive timer's upper bound); a run takes seconds
SUP = {"hang_timeout_s": 120, "startup_timeout_s": 120}
ADAPTER = "adapter_model.safetensors"
LONG = 180   # seconds: a bound for one move of a run on a loaded 2-core machine, never a synchronisation


# ---- processes ------------------------------------------------------------------------------------------
def start(recipe: Path, name: str) -> subprocess.Popen:
    """Starts `orchestrator run RECIPE` as systemd would, its console into files beside the recipe."""
    d = recipe.parent
    with open(d / f"{name}.out", "w") as out, open(d / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)


def finished(p: subprocess.Popen, recipe: Path, name: str) -> int:
    """The exit code of the supervisor `p`, after at most LONG seconds; its console when it failed."""
    try:
        code = p.wait(LONG)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"{name} did not finish: {(recipe.parent / f'{name}.err').read_text()[-3000:]}") from None
    assert code == ExitCode.OK, (recipe.parent / f"{name}.err").read_text()[-3000:]
    return code


def run_processes(out: Path) -> list[psutil.Process]:
    """The live processes of this run (the trainer and its children carry the run's marker)."""
    return local.run_processes(run_id(out))


def kill_run(out: Path) -> None:
    """SIGKILLs every live process of this run, one by one by pid, and waits until none is left."""
    for p in run_processes(out):
        try:
            p.kill()
        except psutil.Error:
            pass
    assert poll(lambda: not run_processes(out), 60), "the run's processes outlived SIGKILL"


def kill(*procs: subprocess.Popen | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(60)


def lock_holder(lock: Path) -> subprocess.Popen:
    """Another process holding the sync lock until its stdin closes (an orphaned rsync round, `sync --once`)."""
    code = ("import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n")
    lock.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    ready, _, _ = select.select([p.stdout], [], [], LONG)
    assert ready and p.stdout is not None and p.stdout.readline().strip() == "locked", "the holder never locked"
    return p


# ---- what the run left ------------------------------------------------------------------------------------
def kv(out: Path) -> dict:
    """The journal's kv, read-only ({} while the journal is not there or busy)."""
    try:
        j = journal(out)
    except (OSError, sqlite3.Error):
        return {}
    try:
        return j.get_all()
    except sqlite3.Error:
        return {}
    finally:
        j.close()


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def published(pub: Path, step: int) -> bool:
    """Tells whether checkpoint-`step` is published in `pub` (a copy is renamed into place, its manifest in it)."""
    return (pub / f"checkpoint-{step}" / MANIFEST).exists()


def family(d: Path, step: int) -> list[str]:
    """checkpoint-`step` and its set-aside copies in `d` (`checkpoint-N.<why>`; not the merged copies)."""
    return [n for n in names(d) if n.split(".")[0] == f"checkpoint-{step}"]


def poll(cond, timeout: float = LONG):
    """wait_for at a pace that leaves the two cores to the run (a journal or a directory read per poll)."""
    return wait_for(cond, timeout, 0.05)


def finite(d: Path) -> bool:
    return scan_safetensors(d / ADAPTER).bad == ()


def synced(out: Path, step: int) -> list[dict]:
    """The journal's `synced` events of checkpoint-`step`."""
    return [e for e in events(out, "synced") if e["message"].startswith(f"published checkpoint-{step} to ")]


def quarantined(out: Path, text: str) -> list[dict]:
    return [e for e in events(out, "quarantine") if text in e["message"]]


def assert_cleared(out: Path) -> None:
    state = kv(out)
    assert not state.get("nan_pending"), state.get("nan_pending")
    assert not state.get("set_aside_pending"), state.get("set_aside_pending")


# ---- a content finding the trainer died right after -------------------------------------------------------
@pytest.mark.parametrize("fault, kind, suffix", [
    ("FAKE_NONFINITE_SAVE", "checkpoint_nonfinite", "checkpoint_nonfinite"),
    ("FAKE_STALE_SAVE", "checkpoint_unchanged", "checkpoint_unchanged"),
], ids=["nonfinite_save", "stale_save"])
def test_a_bad_save_the_trainer_died_right_after_is_never_resumed_from_or_published(tmp_path, fault, kind, suffix):
    recipe = fake_recipe(tmp_path, faults="fla_backward_oom@21", extra_env={fault: "20"}, supervisor=SUP)
    out, pub = tmp_path / "out", published_at(recipe)
    sup = start(recipe, "run")
    try:
        finished(sup, recipe, "run")
    finally:
        kill(sup)
        kill_run(out)
    runs = attempts(out)
    assert [a.cls for a in runs] == [CrashClass.FLA_BACKWARD_OOM, None], [(a.cls, a.evidence) for a in runs]
    assert runs[0].end_step == 20, "the trainer died one step after the bad save"
    assert runs[1].start_step == 10 and runs[1].resumed_from == str(out / "checkpoint-10"), runs[1]
    bad = out / f"checkpoint-20.{suffix}"
    assert bad.is_dir() and not list(out.glob(f"checkpoint-20.{suffix}.*")), names(out)
    if kind == "checkpoint_nonfinite":
        assert not finite(bad), "the renamed copy is the poisoned save"
    (found,) = events(out, kind)
    assert found["data"]["step"] == 20 and "checkpoint-20" in found["message"]
    if kind == "checkpoint_unchanged":
        assert found["data"]["previous_step"] == 10
    # never published (nothing of it to rename there either); the relaunch's healthy saves are
    assert family(pub, 20) == [] and not synced(out, 20) and not quarantined(out, "published checkpoint-20"), names(pub)
    assert published(pub, 40) and finite(pub / "checkpoint-40")
    assert_cleared(out)
    assert not run_processes(out)


# ---- a NaN read after its step's checkpoint was published -------------------------------------------------
def nan_after_publish(tmp_path: Path, **supervisor) -> tuple[Path, Path]:
    """A run whose trainer logs a NaN at step 20 only after checkpoint-20 was saved (a block-buffered stdout),
    holding after the save until the test creates the returned file."""
    go = tmp_path / "go"
    recipe = fake_recipe(tmp_path, faults="nan_loss@20", supervisor={**SUP, **supervisor},
                         extra_env={"FAKE_LATE_LOG": "20", "FAKE_HOLD": f"20:{go}"})
    return recipe, go


def test_a_nan_after_the_checkpoint_was_published_renames_the_published_copy(tmp_path):
    recipe, go = nan_after_publish(tmp_path)
    out, pub = tmp_path / "out", published_at(recipe)
    sup = start(recipe, "run")
    try:
        assert poll(lambda: published(pub, 20)), names(pub)   # healthy when saved: published
        assert not attempts(out)[0].ended_at and not kv(out).get("nan_pending"), "the NaN is not logged yet"
        go.touch()   # the trainer logs the NaN at step 20
        finished(sup, recipe, "run")
    finally:
        kill(sup)
        kill_run(out)
    runs = attempts(out)
    assert [a.cls for a in runs] == [CrashClass.NAN_LOSS, None], [(a.cls, a.evidence) for a in runs]
    assert runs[1].start_step == 10 and runs[1].resumed_from == str(out / "checkpoint-10")
    assert (pub / "checkpoint-20.nan-attempt-1").is_dir() and (out / "checkpoint-20.nan-attempt-1").is_dir()
    (moved,) = quarantined(out, "published checkpoint-20")
    assert "nan-attempt-1" in moved["message"]
    ev = events(out)
    (crash,) = [e for e in ev if e["kind"] == "crash"]
    assert ev.index(synced(out, 20)[0]) < ev.index(crash) < ev.index(moved), "published, then the NaN, then moved"
    assert family(pub, 20) == ["checkpoint-20.nan-attempt-1"], names(pub)
    assert_cleared(out)
    assert not run_processes(out)


def test_a_sync_lock_held_by_another_process_defers_the_published_set_aside(tmp_path):
    recipe, go = nan_after_publish(tmp_path)
    out, pub = tmp_path / "out", published_at(recipe)
    sup = holder = None
    try:
        sup = start(recipe, "run")
        assert poll(lambda: published(pub, 20)), names(pub)
        holder = lock_holder(pub / LOCK)   # a round of another process copying for minutes
        go.touch()
        waiting = lambda: [e for e in events(out, "quarantine") if "wait for the sync lock" in e["message"]]  # noqa: E731
        assert poll(waiting), events(out)[-20:]
        assert "checkpoint-20" in waiting()[0]["message"]
        assert (pub / "checkpoint-20").is_dir() and not (pub / "checkpoint-20.nan-attempt-1").exists(), \
            "the copy stays while the lock is held"
        (req,) = kv(out)["set_aside_pending"]
        assert req["from_step"] == 20 and req["local_done"] and not req["published_done"], req
        assert kv(out).get("nan_pending"), "kept until every copy moved"
        assert (out / "checkpoint-20.nan-attempt-1").is_dir(), "the local copy moved meanwhile"
        assert holder.stdin is not None
        holder.stdin.close()   # the other process ends: its lock goes with it
        assert holder.wait(60) == 0
        assert poll(lambda: (pub / "checkpoint-20.nan-attempt-1").is_dir()), names(pub)
        finished(sup, recipe, "run")
    finally:
        kill(holder, sup)
        kill_run(out)
    (moved,) = quarantined(out, "published checkpoint-20")
    assert "nan-attempt-1" in moved["message"]
    assert events(out).index(moved) > events(out).index(waiting()[0])
    runs = attempts(out)
    assert [a.cls for a in runs] == [CrashClass.NAN_LOSS, None] and runs[1].start_step == 10
    assert_cleared(out)
    assert not run_processes(out)


# ---- the supervisor killed with -9 between the finding and the moves --------------------------------------
@pytest.mark.parametrize("scanned", [True, False],
                         ids=["judged_and_published_before", "saved_after_the_finding"])
def test_a_supervisor_killed_before_the_moves_is_followed_by_one_that_moves_first(tmp_path, scanned):
    go1, go2 = tmp_path / "go1", tmp_path / "go2"
    if scanned:   # checkpoint-20 judged healthy and published, then the NaN at its step logged; holds at step 21
        nan, env = 20, {"FAKE_LATE_LOG": "20", "FAKE_HOLD": f"20:{go1},21:{go2}"}
    else:   # the NaN at step 19 found first, checkpoint-20 saved while the supervisor waits for the trainer to stop
        nan, env = 19, {"FAKE_HOLD": f"19:{go1},20:{go2}"}
    # asked to stop, the trainer goes on for two minutes: the supervisor sits in its grace period with the request
    # recorded and nothing moved
    recipe = fake_recipe(tmp_path, faults=f"nan_loss@{nan}", supervisor={**SUP, "grace_s": 120},
                         extra_env={**env, "FAKE_TERM_S": "120"})
    out, pub = tmp_path / "out", published_at(recipe)
    first = second = None

    def recorded() -> dict | None:
        return next((r for r in kv(out).get("set_aside_pending") or () if not r["local_done"]), None)

    def saved_20() -> bool:
        try:
            return os.readlink(out / "last-checkpoint") == "checkpoint-20"   # the save's last write
        except OSError:
            return False
    try:
        first = start(recipe, "first")
        if scanned:
            assert poll(lambda: published(pub, 20)), names(pub)
            go1.touch()   # the NaN at step 20 is logged
            assert poll(recorded), kv(out)
        else:
            assert poll(recorded), kv(out)
            assert not (out / "checkpoint-20").exists()
            go1.touch()   # the trainer, asked to stop, goes on and saves checkpoint-20
            assert poll(saved_20), names(out)
        req = recorded()
        assert req is not None and req["from_step"] == nan and req["reason"] == "nan", req
        assert (out / "checkpoint-20").is_dir() and family(out, 20) == ["checkpoint-20"], "nothing moved yet"
        first.kill()   # kill -9 of the supervisor ...
        first.wait(60)
        kill_run(out)   # ... and of its trainer
        go2.touch()   # the relaunch holds nowhere
        second = start(recipe, "second")
        finished(second, recipe, "second")
    finally:
        kill(first, second)
        kill_run(out)
    (moved,) = [e for e in quarantined(out, "nan-attempt-1") if e["message"].startswith("checkpoint-20: ")]
    runs = attempts(out)
    assert len(runs) == 2 and runs[1].cls is None, [(a.cls, a.evidence) for a in runs]
    assert moved["at"] <= runs[1].started_at, "the new supervisor moved the copies before it launched"
    assert runs[1].start_step == 10 and runs[1].resumed_from == str(out / "checkpoint-10"), runs[1]
    assert [n for n in family(out, 20) if n != "checkpoint-20"] == ["checkpoint-20.nan-attempt-1"], names(out)
    if scanned:
        (pmoved,) = quarantined(out, "published checkpoint-20")
        assert pmoved["at"] <= runs[1].started_at and family(pub, 20) == ["checkpoint-20.nan-attempt-1"], names(pub)
    else:
        assert family(pub, 20) == [] and not synced(out, 20), "the NaN's checkpoint was never published"
    assert_cleared(out)
    assert not run_processes(out)
