"""The checkpoint tracker in watch mode (act=False): an unfit checkpoint is recorded, advised and left where the
trainer wrote it; nothing is pruned, quarantined or cleaned up (orchestrator/store/tracker.py)."""
from __future__ import annotations

import math

from fake_runs import SWIFT, run
from recipes import DROP, write_recipe

from orchestrator.config.recipe import load
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.store import sync
from orchestrator.types import Standing
from orchestrator.store.tracker import PRUNING, CheckpointTracker


def test_an_unfit_checkpoint_is_left_in_place_and_nothing_is_deleted(tmp_path):
    out = tmp_path / "out"
    assert run(out, *SWIFT, FAKE_NPROC=1).returncode == 0
    adapter = out / "checkpoint-6" / "adapter_model.safetensors"
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(adapter))
    tensors[sorted(tensors)[0]][0, 0] = math.nan
    save_file(tensors, str(adapter), metadata={"format": "pt"})
    (out / f"{PRUNING}checkpoint-1").mkdir()  # a supervisor's half-done delete: not the watcher's to finish
    path = write_recipe(tmp_path, run={"backend": "swift", "output_dir": str(out)},
                        lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                        parallel={"nproc_per_node": 1, "expert": DROP})
    j = Journal(tmp_path / "journal.sqlite")
    before = sorted(p.name for p in out.iterdir())
    rc = CheckpointTracker(load(path), "hash", out, j, Metrics(), on_saved=lambda: None, in_flight=sync.InFlight(),
                           act=False)
    rc.scan(0.0)
    rc.close()
    [f] = rc.left_in_place
    assert f.last_step == 6 and f.kind == "checkpoint_nonfinite"
    [ev] = [e for e in j.events(200) if e["kind"] == "checkpoint_nonfinite"]
    assert ev["message"].endswith("left in place (watch mode)")
    assert not {c["step"]: c for c in j.checkpoints()}[6]["ok"] and rc.newest_good_step() == 4
    assert rc.prune(0, pressure=True, writing=False) == 0
    assert rc.standings.of(6).standing is Standing.SET_ASIDE and rc.resume_point().step == 4  # in standing only
    assert rc.standings.pending and not rc.standings.pending[0].local_done   # left for `run` to move
    assert sorted(p.name for p in out.iterdir()) == before  # nothing renamed, deleted or cleaned up
    j.close()
