"""Fault injection over every file the orchestrator owns (README "Reliability: our own files under faults").

Each row takes a run that stopped half way (it gave up on an `other` crash at step 25: checkpoint-10
and -20 verified, manifested and published), damages one file, and runs `orchestrator run` again as systemd
would: the documented exit code and console line, no traceback, and the training resumed when it can.
The mid-run faults (the persistent directory vanishing or turning into a file, another process holding the
journal's write lock, the journal overwritten while open) run a supervisor in a thread and strike mid-training.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
from supervised import attempts, cli, events, fake_recipe, wait_for

from orchestrator.config.recipe import load
from orchestrator.host import journal as J
from orchestrator.host.journal import journal_path
from orchestrator.store.manifest import MANIFEST
from orchestrator.store.published import PUBLISHER_LOCK
from orchestrator.store.rundir import state_dir
from orchestrator.store.sync import LOCK as SYNC_LOCK
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import ExitCode

NO_FAULTS = ("--set", 'env.vars.FAKE_FAULTS=""')  # the second run: the stopped run's `other` crash is over


@pytest.fixture
def run_copy(tmp_path) -> Path:
    """A run that stopped half way: it gave up on an `other` crash at step 25 (exit 3) with checkpoint-10 and
    -20 verified, manifested and published. (Made afresh per row: a copied directory is another recipe hash,
    its model and data paths being elsewhere.)"""
    recipe = fake_recipe(tmp_path, faults="other@25", state=False)
    r = cli("run", str(recipe))
    assert r.returncode == ExitCode.GAVE_UP, r.stderr[-2000:]
    assert {p.name for p in (tmp_path / "out").glob("checkpoint-*")} == {"checkpoint-10", "checkpoint-20"}
    return tmp_path


def _journal(d: Path) -> Path:
    return journal_path(state_dir(d / "out"))


def _publish_dir(d: Path) -> Path:
    return next((d / "persist").iterdir())


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(8192))


def _sql(statements: str):
    def fault(p: Path) -> None:
        db = sqlite3.connect(p)
        db.executescript(statements)
        db.close()
    return fault


def _replace_with_dir(p: Path) -> None:
    p.unlink(missing_ok=True)
    p.mkdir()


def _node_json(d: Path, content: str) -> None:
    node = Path(os.environ["ORCHESTRATOR_NODE_STATE_DIR"])
    node.mkdir(parents=True, exist_ok=True)
    (node / "node.json").write_text(content)


def _manifest_hash(p: Path, h: str) -> None:
    m = json.loads((p / MANIFEST).read_text())
    m["recipe_hash"] = h
    (p / MANIFEST).write_text(json.dumps(m))


def _relink(out: Path, target: str) -> None:
    (out / "last-checkpoint").unlink()
    (out / "last-checkpoint").symlink_to(target)


# (id, the fault, exit code, words on the console (stderr), the step the run resumes from: None = nothing launched)
ROWS = [
    ("journal: garbage bytes", lambda d: _garbage(_journal(d)), 0, "journal_replaced", 20),
    ("journal: truncated", lambda d: os.truncate(_journal(d), 3000), 0, "journal_replaced", 20),
    ("journal: zero bytes", lambda d: os.truncate(_journal(d), 0), 0, "journal_replaced", 20),
    ("journal: malformed table", lambda d: _sql("DROP TABLE attempts; CREATE TABLE attempts (x);")(_journal(d)),
     0, "journal_replaced", 20),
    ("journal: a newer release's", lambda d: _sql("PRAGMA user_version = 7;")(_journal(d)), 0, "journal_replaced",
     20),
    ("journal: a stale -wal beside it", lambda d: Path(f"{_journal(d)}-wal").write_bytes(os.urandom(4096)), 0,
     "resuming from", 20),
    ("node history: garbage", lambda d: _node_json(d, "\x00{not json"), 0, "resuming from", 20),
    ("node history: a non-number", lambda d: _node_json(d, '{"runs": {"x": {"failures": "many", "hours": 1}}}'),
     0, "resuming from", 20),
    ("run lock: garbage inside", lambda d: (state_dir(d / "out") / "lock").write_bytes(b"\xff" * 64), 0,
     "resuming from", 20),
    ("run lock: a directory in its place", lambda d: _replace_with_dir(state_dir(d / "out") / "lock"), 2,
     "cannot open the run lock", None),
    ("publisher lock: garbage inside", lambda d: (_publish_dir(d) / PUBLISHER_LOCK).write_bytes(b"\xff" * 64), 0,
     "resuming from", 20),
    ("publisher lock: a directory in its place", lambda d: _replace_with_dir(_publish_dir(d) / PUBLISHER_LOCK), 2,
     "cannot create", None),
    ("sync lock: a directory in its place", lambda d: _replace_with_dir(_publish_dir(d) / SYNC_LOCK), 0,
     "sync_problem", 20),
    ("manifest: garbage (newest local)", lambda d: (d / "out" / "checkpoint-20" / MANIFEST).write_text("{"), 0,
     "resuming from", 20),
    ("manifest: another recipe's (newest local)", lambda d: _manifest_hash(d / "out" / "checkpoint-20", "f" * 64),
     0, "resume_skip", 10),
    ("manifest: garbage (newest published)", lambda d: (_publish_dir(d) / "checkpoint-20" / MANIFEST).write_text(""),
     0, "resuming from", 20),
    ("last-checkpoint: pointing nowhere", lambda d: _relink(d / "out", "checkpoint-99"), 0, "resuming from", 20),
    ("last-checkpoint: not a checkpoint name", lambda d: _relink(d / "out", "garbage"), 0, "resuming from", 20),
    ("persistent dir: gone before the start", lambda d: shutil.rmtree(d / "persist"), 0, "resuming from", 20),
    ("persistent dir: a file in its place", lambda d: (shutil.rmtree(d / "persist"), (d / "persist").write_text("")),
     2, "run.persistent_dir: cannot create", None),
]


@pytest.mark.parametrize("name,fault,code,says,resumed", ROWS, ids=[r[0] for r in ROWS])
def test_a_fault_in_our_own_files(run_copy, name, fault, code, says, resumed):
    recipe = str(run_copy / "r.toml")
    before = len(attempts(run_copy / "out"))
    fault(run_copy)
    if name.startswith("journal:") and says == "journal_replaced":
        for command in ("status", "history", "report"):
            r = cli(command, recipe)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (command, r.stderr)
            assert str(_journal(run_copy)) in lines[0] and "`orchestrator run` will move it aside" in lines[0]
    r = cli("run", recipe, *NO_FAULTS)
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert says in r.stderr, r.stderr[-3000:]
    rows = attempts(run_copy / "out")
    if resumed is None:
        assert len(rows) == before, "nothing launched"
        assert len([ln for ln in r.stderr.splitlines() if ln.startswith("orchestrator: error:")]) == 1
        return
    last = rows[-1]
    assert last.resumed_from == str(run_copy / "out" / f"checkpoint-{resumed}") and last.end_step == 40, last
    assert last.n == 2, "attempt numbers go on after the stopped run's attempt 1 (its log is kept)"
    assert (state_dir(run_copy / "out") / "attempts" / "attempt-0001.log").stat().st_size > 0
    if says == "journal_replaced":
        (event,) = events(run_copy / "out", "journal_replaced")
        assert event["data"]["rebuilt"]["checkpoints"] == [10, 20] and "goodput before now" in event["message"]
        assert Path(event["data"]["moved_to"]).exists(), "the damaged journal is kept beside the new one"
    assert cli("status", recipe).returncode == 0


# ------------------------------------------------------------------------------------ mid-run faults

def _supervise_in_thread(recipe: Path):
    sup = Supervisor(load(recipe, ['env.vars.FAKE_FAULTS=""']), install_signals=False)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", sup.run()))
    thread.start()
    return sup, thread, result


def _midrun(tmp_path, strike, *, iterations: int = 60):
    """A fresh run (3 s of training) with `strike(sup)` once it passed step 15; returns (exit code, supervisor)."""
    recipe = fake_recipe(tmp_path, iterations=iterations, save_steps=5, extra_env={"FAKE_STEP_S": "0.05"})
    sup, thread, result = _supervise_in_thread(recipe)
    try:
        assert wait_for(lambda: sup.attempt and sup.attempt.last and sup.attempt.last.step >= 15, 60, 0.02)
        strike(sup)
        thread.join(120)
        assert not thread.is_alive()
    finally:
        if thread.is_alive():
            sup.request_stop("test over")
            thread.join(60)
    return result.get("code"), sup


@pytest.mark.parametrize("turns_into", ["gone", "a file"])
def test_the_persistent_dir_vanishing_mid_run(tmp_path, turns_into):
    def strike(_sup) -> None:
        os.rename(tmp_path / "persist", tmp_path / "persist.moved")
        if turns_into == "a file":
            (tmp_path / "persist").write_text("not a directory")
    code, _ = _midrun(tmp_path, strike)
    assert code == ExitCode.OK, "training completes: publishing is not training"
    assert attempts(tmp_path / "out")[-1].end_step == 60
    if turns_into == "a file":
        assert events(tmp_path / "out", "sync_problem"), "every round that cannot publish says so"
    else:  # the directory is made again and the final sync publishes the newest checkpoint
        assert (next((tmp_path / "persist").iterdir()) / "checkpoint-60" / MANIFEST).exists()
    assert (tmp_path / "out" / "checkpoint-60").is_dir(), "nothing local lost"


def test_another_process_holding_the_journal_lock_mid_run(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "LOCK_WAIT_S", 0.5)
    monkeypatch.setattr(J, "HOLD_RETRY_S", 0.5)
    path = journal_path(state_dir(tmp_path / "out"))
    held_at: list[int] = []

    def strike(sup) -> None:
        other = sqlite3.connect(path, isolation_level=None, timeout=5)
        other.execute("BEGIN IMMEDIATE")
        try:
            assert wait_for(lambda: sup.ctx.journal.held, 20, 0.05), "writes are held while the lock is taken"
            held_at.append(sup.attempt.last.step)
            assert wait_for(lambda: sup.attempt.last.step >= held_at[0] + 10, 30, 0.05), "training goes on"
        finally:
            other.close()
    code, _ = _midrun(tmp_path, strike)
    assert code == ExitCode.OK
    rows = attempts(tmp_path / "out")
    assert rows[-1].end_step == 60 and all(r.ended_at for r in rows)
    (held,) = events(tmp_path / "out", "journal_held")
    assert "write lock" in held["message"]
    assert [e for e in events(tmp_path / "out", "checkpoint") if "checkpoint-60" in e["message"]]


def test_the_journal_overwritten_while_open(tmp_path):
    """Garbage written over the open journal and its WAL (same files, as a stray editor or a bad restore would):
    the supervisor never dies of it (what it cannot read is empty, what it cannot write is held) and completes
    the training; whatever SQLite made of the file, `status` says it in one line and the next `run` goes on."""
    path = journal_path(state_dir(tmp_path / "out"))

    def strike(_sup) -> None:
        for p in (path, Path(f"{path}-wal")):
            size = p.stat().st_size
            with open(p, "r+b") as f:
                f.write(os.urandom(size))
    code, _ = _midrun(tmp_path, strike, iterations=40)
    assert code == ExitCode.OK
    recipe = str(tmp_path / "r.toml")
    r = cli("status", recipe)
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0 or "will move it aside" in r.stderr, r.stderr
    r = cli("run", recipe)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert cli("status", recipe).returncode == 0
