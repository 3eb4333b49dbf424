"""Local retention beside the publisher: it copies only the newest verified checkpoint, so an older unpublished
one is superseded and may be deleted, except the one being copied (sync.InFlight, taken under the lock that
retention decides and renames under). Real megatron-format checkpoints, a real journal."""
from __future__ import annotations

from pathlib import Path

from recipes import write_recipe
from checkpoint_dirs import make_megatron
from orchestrator.config.recipe import load
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.store import sync
from orchestrator.store.tracker import CheckpointTracker


def tracker(tmp_path: Path, in_flight: sync.InFlight) -> tuple[Path, CheckpointTracker]:
    recipe = load(write_recipe(tmp_path, run={"persistent_dir": str(tmp_path / "pers")},
                               lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
    out = tmp_path / "out"
    for step in (10, 20, 30):
        make_megatron(out, step)
    rc = CheckpointTracker(recipe, "hash", out, Journal(tmp_path / "journal.sqlite"), Metrics(),
                           on_saved=lambda: None, in_flight=in_flight)
    rc.scan(0.0)
    assert rc.wait_checks(60)   # healthy: retention counts only checkpoints whose content check passed
    return out, rc


def names(out: Path) -> list[str]:
    return sorted(d.name for d in out.glob("checkpoint-*"))


def test_superseded_unpublished_checkpoints_go_but_never_the_one_being_copied(tmp_path):
    in_flight = sync.InFlight()
    out, rc = tracker(tmp_path, in_flight)
    assert in_flight.take(str(out / "checkpoint-10"))  # a round took 10 while it was the newest
    assert rc.prune(keep=1, pressure=False) == 1
    assert names(out) == ["checkpoint-10", "checkpoint-30"]  # 20: superseded; 30: the newest
    in_flight.release()
    assert rc.prune(keep=1, pressure=False) == 1 and names(out) == ["checkpoint-30"]
    rc.close()


def test_retention_decides_and_renames_under_the_in_flight_lock(tmp_path, monkeypatch):
    """So a round never takes a checkpoint retention has doomed: once renamed, take() fails."""
    in_flight = sync.InFlight()
    out, rc = tracker(tmp_path, in_flight)
    held, rename = [], Path.rename

    def watched(self, target):
        held.append(in_flight.lock.locked())
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", watched)
    assert rc.prune(keep=1, pressure=False) == 2 and held == [True, True]
    assert not in_flight.take(str(out / "checkpoint-20")) and in_flight.path is None
    rc.close()
