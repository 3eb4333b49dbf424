"""Who raises and clears each supervisor-owned alert: checkpoint_invalid, against real checkpoints on disk
(verified with the real verifier), a real journal and real metrics."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from supervised import write_recipe
from checkpoint_dirs import make_megatron

from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.config.recipe import load
from orchestrator.store.tracker import CheckpointTracker

STUB = b'{"__metadata__": {"format": "pt"}}'  # a header and no tensors: complete, fails verification


def write(out: Path, step: int, ok: bool) -> None:
    d = out / f"checkpoint-{step}"
    if d.exists():  # a relaunch rewrites the step
        shutil.rmtree(d)
    make_megatron(out, step)
    if not ok:
        (d / "adapter_model.safetensors").write_bytes(len(STUB).to_bytes(8, "little") + STUB)


@pytest.fixture
def tracked(tmp_path: Path):
    recipe = load(write_recipe(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    metrics = Metrics()
    journal = Journal(tmp_path / "journal.sqlite")
    rc = CheckpointTracker(recipe, "hash", out, journal, metrics, on_saved=lambda: None)
    yield out, rc, metrics
    rc.close()


# Each scan: the checkpoints written (step, verifies ok) before it, an optional forget_after(step) first
# (a relaunch from that step), and whether checkpoint_invalid is raised after it.
SCANS = {
    "good": [([(10, True)], None, 0)],
    "bad then newer good": [([(10, True)], None, 0), ([(20, False)], None, 1), ([(30, True)], None, 0)],
    "found together at start-up, newest good": [([(20, False), (30, True)], None, 0)],
    "found together at start-up, newest bad": [([(20, True), (30, False)], None, 1)],
    "an older good one does not clear it": [([(30, False)], None, 1), ([(20, True)], None, 1)],
    "stays raised across a relaunch until a newer one verifies ok": [
        ([(10, True), (20, False)], None, 1), ([], 10, 1), ([(30, True)], None, 0)],
    "a rewrite that fails again raises it again": [
        ([(10, True), (20, True)], None, 0), ([(20, False)], 10, 1)],
}


@pytest.mark.parametrize("scans", SCANS.values(), ids=SCANS.keys())
def test_checkpoint_invalid_raised_by_the_newest_and_cleared_by_a_newer_good_one(tracked, scans):
    out, rc, metrics = tracked
    for i, (written, forget_after, raised) in enumerate(scans):
        if forget_after is not None:
            rc.forget_after(forget_after)
        for step, ok in written:
            write(out, step, ok)
        rc.scan(now=0.0)
        value = metrics.registry.get_sample_value("orchestrator_alert_active", {"alert": "checkpoint_invalid"})
        assert value == raised, f"after scan {i}"


def test_every_failure_is_still_counted(tracked):
    out, rc, metrics = tracked
    for step, ok in ((10, False), (20, True), (30, False)):
        write(out, step, ok)
    rc.scan(now=0.0)
    assert metrics.registry.get_sample_value("orchestrator_checkpoint_invalid_total") == 2
