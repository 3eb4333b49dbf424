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


def test_a_garbage_journal_is_replaced_and_the_training_completes(tiny, tmp_path):
    out = tmp_path / "out"
    first = Supervisor(recipe(tiny, tmp_path), install_signals=False)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", first.run()))
    thread.start()
    try:
        assert wait_for(lambda: first.checkpoints and first.checkpoints.newest_good_step() >= 10, 300, 0.1), \
            "checkpoint-10 verified"
        first.request_stop("test: the operator stops the run half way")
        thread.join(300)
    finally:
        if thread.is_alive():
            first.request_stop("test over")
            thread.join(60)
    assert result["code"] == ExitCode.OK and first.state is State.STOPPED
    stopped_at = attempts(out)[-1].end_step
    assert stopped_at is not None and stopped_at < 30

    journal = journal_path(state_dir(out))
    journal.write_bytes(os.urandom(16384))  # a disk hiccup, a bad copy, a stray editor
    second = Supervisor(recipe(tiny, tmp_path), install_signals=False)
    assert second.run() == ExitCode.OK and second.state is State.COMPLETED

    (replaced,) = events(out, "journal_replaced")
    assert replaced["data"]["problem"] == "file is not a database"
    assert 10 in replaced["data"]["rebuilt"]["checkpoints"]
    assert (state_dir(out) / os.path.basename(replaced["data"]["moved_to"])).exists(), "kept, never deleted"
    rows = attempts(out)
    assert len(rows) == 1 and rows[0].n == 2, "the new journal's first attempt is numbered after the old log"
    assert rows[0].resumed_from is not None and rows[0].start_step >= 10 and rows[0].end_step == 30
