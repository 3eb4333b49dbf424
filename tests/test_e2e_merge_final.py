"""checkpoint.merge = "final" for real: the demo recipe's `swift sft` LoRA run on CPU, then a real
`swift export --adapters <last checkpoint> --merge_lora true` supervised as the run's final attempt,
verified (checkpoints.verify_merged) and published as checkpoint-N-merged next to checkpoint-N."""
from __future__ import annotations

import importlib.util

import pytest

from orchestrator.store import checkpoints, manifest
from orchestrator.host.journal import Journal, journal_path
from orchestrator.store.published import publish_dir
from orchestrator.config.recipe import recipe_hash
from orchestrator.store.rundir import state_dir
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import ExitCode
from swift_recipe import recipe

pytestmark = [pytest.mark.swift,
              pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")]


def test_the_demo_ends_with_a_verified_published_merged_model(tiny, tmp_path):  # noqa: F811
    r = recipe(tiny, tmp_path, "optim.iterations=20", 'checkpoint.merge="final"')
    assert r.checkpoint.merge == "final"
    assert Supervisor(r, install_signals=False).run() == ExitCode.OK
    out = tmp_path / "out"
    j = Journal(journal_path(state_dir(out)), readonly=True)
    attempts = j.attempts()
    assert [a.kind for a in attempts] == ["train", "export"] and all(a.cls is None for a in attempts)
    assert attempts[1].resumed_from == str(out / "checkpoint-20")
    launch = [e for e in j.events(1000) if e["kind"] == "launch"][-1]["data"]["argv"]
    assert launch[:2] == ["swift", "export"] and "--merge_lora" in launch
    pub = publish_dir(r.run.persistent_dir, r.run.name, recipe_hash(r)) / "checkpoint-20-merged"
    v = checkpoints.verify_merged(pub)
    assert v.ok and v.tensors > 0, v.problems
    m = manifest.read_manifest(pub)
    assert m is not None and not manifest.manifest_matches(pub, m), "published with its manifest, hashes intact"
    assert j.get_all()["merged_synced"] == [20]
    assert not list(out.glob(".partial-*")), "no staging directory is left behind"
