"""End to end against the real stack: a garbage journal never stops `run`. A real `swift sft` LoRA run of the
tiny MoE (CPU, offline) is stopped half way, its journal overwritten with garbage bytes; the next supervisor
moves the journal aside, rebuilds it from the checkpoints on disk and completes the training from the newest
verified checkpoint."""
from __future__ import annotations

import importlib.util
import os
import threading

import pytest
from supervised import attempts, events, wait_for
from swift_recipe import recipe

from orchestrator.host.journal import journal_path
from orchestrator.store.rundir import state_dir
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import ExitCode, State

pytestmark = [pytest.mark.swift,
              pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")]


# Long enough that the stop lands before the end: the tiny model trains ~15 steps a second on a quiet machine.
STEPS = 300
LONG = (f"optim.iterations={STEPS}", "checkpoint.save_steps=10")


def test_a_garbage_journal_is_replaced_and_the_training_completes(tiny, tmp_path):
    out = tmp_path / "out"
    first = Supervisor(recipe(tiny, tmp_path, *LONG), install_signals=False)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", first.run()))
    thread.start()
    try:
        def saved_10() -> bool:  # ms-swift points last-checkpoint at a save once it is written
            try:
                return os.readlink(out / "last-checkpoint").rstrip("/").endswith("checkpoint-10")
            except OSError:
                return False
        assert wait_for(saved_10, 300, 0.02), "checkpoint-10 written"
        first.request_stop("test: the operator stops the run half way")
        thread.join(300)
    finally:
        if thread.is_alive():
            first.request_stop("test over")
            thread.join(60)
    assert result["code"] == ExitCode.OK and first.state is State.STOPPED
    stopped_at = attempts(out)[-1].end_step
    assert stopped_at is not None and stopped_at < STEPS

    journal = journal_path(state_dir(out))
    journal.write_bytes(os.urandom(16384))  # a disk hiccup, a bad copy, a stray editor
    second = Supervisor(recipe(tiny, tmp_path, *LONG), install_signals=False)
    assert second.run() == ExitCode.OK and second.state is State.COMPLETED

    (replaced,) = events(out, "journal_replaced")
    assert replaced["data"]["problem"] == "file is not a database"
    rebuilt = replaced["data"]["rebuilt"]["checkpoints"]   # what local retention kept of the first run's saves
    assert rebuilt and min(rebuilt) >= 10
    assert (state_dir(out) / os.path.basename(replaced["data"]["moved_to"])).exists(), "kept, never deleted"
    rows = attempts(out)
    assert len(rows) == 1 and rows[0].n == 2, "the new journal's first attempt is numbered after the old log"
    assert rows[0].resumed_from is not None and rows[0].start_step == max(rebuilt) and rows[0].end_step == STEPS
