"""Issue 10's scenario with the real `swift sft` demo trainer (ms-swift, tiny MoE, CPU, offline): run A is
running; the same recipe with `--set optim.lr=2e-4` starts meanwhile (drift: a fresh output dir); both
publish into one persistent_dir; nothing is lost, and `sync --once` of A leaves B's copies alone."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from supervised import wait_for
from isolation_check import assert_copies_are_the_runs, snapshot

from orchestrator.store.published import copies_in, publish_dir
from orchestrator.config.recipe import load, recipe_hash
from supervised import attempts, cli, free_port_range, logged_steps

pytestmark = [pytest.mark.swift,
              pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")]

DEMO = Path(__file__).resolve().parents[1] / "orchestrator" / "data" / "demo-cpu.toml"
STEPS = 40


def test_a_drifted_run_beside_a_running_one_loses_nothing(tiny, tmp_path):
    lo, hi = free_port_range(20)
    sets = [f"model.path={json.dumps(tiny['model'])}", f"data.dataset=[{json.dumps(tiny['data'])}]",
            f"run.output_dir={json.dumps(str(tmp_path / 'out'))}",
            f"run.persistent_dir={json.dumps(str(tmp_path / 'persist'))}",
            f"optim.iterations={STEPS}", "checkpoint.save_steps=10", "metrics.enabled=false",
            "supervisor.wait_s=0.5", "supervisor.poll_s=0.1", f"supervisor.port_range=[{lo}, {hi}]",
            'checkpoint.merge="never"']  # about the trainings side by side; the export: test_e2e_merge_final
    args = [a for s in sets for a in ("--set", s)]
    run = [sys.executable, "-m", "orchestrator", "run", str(DEMO), *args]
    ra, rb = load(DEMO, sets), load(DEMO, [*sets, "optim.lr=2e-4"])
    ha, hb = recipe_hash(ra), recipe_hash(rb)
    out_a, out_b = tmp_path / "out", tmp_path / f"out-{hb[:8]}"
    pub_a, pub_b = (publish_dir(tmp_path / "persist", ra.run.name, h) for h in (ha, hb))

    a = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (out_a / "checkpoint-10" / "adapter_model.safetensors").exists() or a.poll() is not None,
                        300, 0.1)
        assert a.poll() is None, "run A ended before run B could start beside it"
        b = subprocess.Popen([*run, "--set", "optim.lr=2e-4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err_b = b.communicate(timeout=600)
    finally:
        _, err_a = a.communicate(timeout=600)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    assert "drift" in err_b and str(out_b) in err_b
    assert attempts(out_b)[0].started_at < attempts(out_a)[-1].ended_at, "the two trainings overlapped"

    # nothing lost: every step trained in both runs, each run's copies are its own and byte-identical
    assert sorted(set(logged_steps(out_a))) == list(range(1, STEPS + 1))
    assert sorted(set(logged_steps(out_b))) == list(range(1, STEPS + 1))
    names_a = assert_copies_are_the_runs(pub_a, out_a, ha)
    names_b = assert_copies_are_the_runs(pub_b, out_b, hb)
    assert f"checkpoint-{STEPS}" in names_a and f"checkpoint-{STEPS}" in names_b
    assert not copies_in(tmp_path / "persist"), "nothing published outside the runs' own directories"

    # `sync --once` of A (the last step) copies nothing and touches nothing of B's
    before_a, before_b = snapshot(pub_a), snapshot(pub_b)
    r = cli("sync", str(DEMO), "--once", "--json", *args)
    assert r.returncode == 0 and json.loads(r.stdout)["copied"] == 0, r.stdout + r.stderr
    assert snapshot(pub_b) == before_b and snapshot(pub_a) == before_a

    # status of A speaks of A's copies
    s = cli("status", str(DEMO), "--json", *args)
    sync = json.loads(s.stdout)["sync"]
    assert sync["destination"] == str(pub_a) and sync["last_synced_step"] == STEPS and sync["lag_steps"] == 0
