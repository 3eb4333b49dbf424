"""Local retention on a real small filesystem (a size-limited tmpfs mounted by the test as root; skipped with
the reason elsewhere): a run whose checkpoints would fill the disk without retention completes with it, the
resume point and unpublished checkpoints are never deleted, and a kill -9 mid-prune loses nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from supervised import attempts, events, fake_recipe, journal, published_at, supervise
from orchestrator.types import ExitCode

MIB = 1 << 20


def test_checkpoints_that_would_fill_the_disk_fit_with_retention(tmp_path, small_disk):
    out = small_disk / "out"
    # 12 saves x 8 ranks x 1 MiB = 96+ MiB of checkpoints on a 48 MiB disk: only retention makes it fit.
    recipe = fake_recipe(tmp_path, iterations=36, save_steps=3, extra_env={"FAKE_SHARD_MB": "1", "FAKE_STEP_S": "0.1"},
                         checkpoint={"keep_local": 2, "sync_interval_s": 1}, supervisor={"min_free_gib": 0.004})
    code, sup = supervise(recipe, f"run.output_dir={json.dumps(str(out))}")
    assert code == ExitCode.OK, sup.exit_reason
    runs = attempts(out)
    assert runs[-1].end_step == 36
    pruned = events(out, "prune")
    assert len(pruned) >= 8, [e["message"] for e in pruned]
    kept = sorted(int(d.name.split("-")[1]) for d in out.glob("checkpoint-*") if d.name.split("-")[1].isdigit())
    assert kept[-1] == 36 and len(kept) <= 3, kept
    j = journal(out)
    synced = {c["step"]: c["synced_at"] for c in j.checkpoints()}
    j.close()
    for e in pruned:  # only published ones went (after they were), ones sync never copies, or torn saves
        step = int(e["message"].split("checkpoint-")[1].split(":")[0])
        if "torn" in e["message"] or "superseded" in e["message"]:
            continue
        assert synced[step] is not None and synced[step] <= e["at"], e
    assert (published_at(recipe) / "checkpoint-36").is_dir(), "the newest was published before it could go"


def test_a_kill_during_pruning_loses_nothing(tmp_path):
    """A process that decided to prune checkpoint-10 is killed between the rename and the delete: its successor
    finishes the delete, and every other checkpoint is intact."""
    from checkpoint_dirs import make_megatron  # a real-format megatron checkpoint

    out = tmp_path / "out"
    for step in (10, 20, 30):
        make_megatron(out, step)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    recipe = fake_recipe(tmp_path)
    script = textwrap.dedent(f"""
        import os, shutil, signal
        from pathlib import Path
        from orchestrator.domain import retention
        from orchestrator.config.recipe import load
        from orchestrator.store.tracker import CheckpointTracker
        out = {json.dumps(str(out))}
        class Journal:
            def checkpoints(self): return []
            def get_all(self): return dict()
            def event(self, *a, **k): pass
        rc = CheckpointTracker(load({json.dumps(str(recipe))}), "h", Path(out), Journal(), None, None)
        rc.seen = {{out + "/checkpoint-10": True}}
        retention.plan_prune = lambda *a, **k: [retention.Prune(out + "/checkpoint-10", "test")]
        shutil.rmtree = lambda path, **k: os.kill(os.getpid(), signal.SIGKILL)   # killed mid-delete
        rc.prune(1, False)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == -9, "the pruning process was killed mid-delete"
    assert not (out / "checkpoint-10").exists() and list(out.glob(".orchestrator-pruning-*")), "renamed first"
    from orchestrator.config.recipe import load
    from orchestrator.store.tracker import CheckpointTracker

    CheckpointTracker(load(recipe), "h", out, None, None, None)   # the successor's start
    assert not list(out.glob(".orchestrator-pruning-*")), "the successor finished the decided delete"
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == {k: v for k, v in before.items() if k.parts[0] != "checkpoint-10"}, "nothing else lost"
