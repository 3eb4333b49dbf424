"""A real full disk (a size-limited tmpfs, mounted by the test as root) under a supervised run: the
supervisor stays up, reports disk_full, and resumes training when space returns, every attempt
recorded. Skipped with the reason where tmpfs cannot be mounted."""
from __future__ import annotations

import json
import threading

from disk import fill
from supervised import attempts, events, fake_recipe, wait_for
from orchestrator.config.recipe import load
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import Action, CrashClass, ExitCode, State


def test_a_disk_filled_by_something_else_while_training(tmp_path, small_disk):
    out = small_disk / "out"
    recipe = fake_recipe(tmp_path, iterations=60, save_steps=5, extra_env={"FAKE_STEP_S": "0.05"},
                         supervisor={"min_free_gib": 0.004, "wait_s": 0.2})
    sup = Supervisor(load(recipe, [f"run.output_dir={json.dumps(str(out))}"]), install_signals=False)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", sup.run()))
    thread.start()
    filler = small_disk / "filler.bin"
    try:
        assert wait_for(lambda: sup.attempt and sup.attempt.last and sup.attempt.last.step >= 12, 60, 0.02)
        fill(filler)   # something else fills the disk: the trainer's next write fails with a real ENOSPC
        assert wait_for(lambda: sup.state is State.WAITING and sup.attempt.decision is not None
                        and sup.attempt.decision.action is Action.WAIT_FOR_SPACE, 60, 0.02), sup.state
        assert sup.attempt.crash.cls is CrashClass.DISK_FULL, sup.attempt.crash
        assert thread.is_alive(), "the supervisor survives the full disk"
        assert wait_for(lambda: sup.ctx.journal.held, 10, 0.02), "journal writes are held, not lost"
        filler.unlink()
        thread.join(120)
        assert not thread.is_alive()
    finally:
        filler.unlink(missing_ok=True)
        if thread.is_alive():
            sup.request_stop("test over")
            thread.join(60)
    assert result["code"] == ExitCode.OK and sup.state is State.COMPLETED
    rows = attempts(out)
    assert len(rows) >= 2 and rows[0].cls is CrashClass.DISK_FULL and rows[-1].end_step == 60
    assert all(r.ended_at is not None for r in rows), "every attempt recorded"
    assert any(e["kind"] == "disk_full" for e in events(out)), "the held writes were replayed"
    assert rows[1].start_step > 0, "resumed from a checkpoint saved before the disk filled"
