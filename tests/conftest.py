"""Shared fixtures. Helpers live in tests/support/ (on sys.path from here, so tests import them by name:
`from fake_host import FakeHost`); no test module imports another."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from loop_world import supervisors  # noqa: E402
from recipes import write_recipe  # noqa: E402
from slurm_cluster import cluster  # noqa: E402, F401 (the module-scoped 3-node cluster fixture)


# 8 GPUs, EP 8 over a 16-expert model, DP 8, global batch 16.


@pytest.fixture(name="write_recipe")
def write_recipe_in_tmp_path(tmp_path):
    """write_recipe(name="recipe.toml", **sections) -> Path, in tmp_path."""
    return functools.partial(write_recipe, tmp_path)


@pytest.fixture(scope="session", autouse=True)
def _node_state_dir_session(tmp_path_factory):
    """Module-scoped fixtures (a finished run shared by a module's tests) run supervisors before the per-test
    fixture below: their node history goes to a temporary directory too, never the machine's."""
    old = os.environ.get("ORCHESTRATOR_NODE_STATE_DIR")
    os.environ["ORCHESTRATOR_NODE_STATE_DIR"] = str(tmp_path_factory.mktemp("node-state-session"))
    yield
    if old is None:
        os.environ.pop("ORCHESTRATOR_NODE_STATE_DIR", None)
    else:
        os.environ["ORCHESTRATOR_NODE_STATE_DIR"] = old


@pytest.fixture(autouse=True)
def _node_state_dir(tmp_path_factory, monkeypatch):
    """Every test's supervisors keep their node history (node_history.py) in a temporary directory, never ~."""
    monkeypatch.setenv("ORCHESTRATOR_NODE_STATE_DIR", str(tmp_path_factory.mktemp("node-state")))


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(options, name) -> a fresh size-limited tmpfs under tmp_path, unmounted after the test: a real
    filesystem that fills up. Needs root and mount permission; skipped with the reason otherwise."""
    mounted = []

    def mount(options: str = "size=48m", name: str = "disk") -> Path:
        d = tmp_path / name
        d.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d
    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def small_disk(mount_tmpfs):
    """A 48 MiB tmpfs: the full-disk and retention tests' disk."""
    return mount_tmpfs("size=48m")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny MoE and its chat dataset (orchestrator/ops/tiny.py), built once for every real-swift test."""
    from orchestrator.ops import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def world(write_recipe):
    """make(**sections) -> (Supervisor, FakeHost): supervisors on the in-memory host, shut down after the test."""
    yield from supervisors(write_recipe)


@pytest.fixture
def procs():
    """A list the test appends the processes it starts to; each is ended afterwards (by_hand.end: its group)."""
    from by_hand import end
    started: list = []
    yield started
    for p in reversed(started):
        end(p)


# Helpers whose use makes a test end to end: real processes under a supervisor, a Slurm cluster, Prometheus.
E2E_HELPERS = frozenset({"supervised", "prom", "chaos", "slurm_cluster", "swift_recipe"})
E2E_MODULES = frozenset({"test_demo", "test_swift_parse", "test_fake_trainer", "test_evidence", "test_setup",
                         "test_service", "test_bench_smoke"})


def pytest_collection_modifyitems(items):
    """Marks the end-to-end tests `e2e` (the fast part is -m "not e2e"): those in a module that uses an end-to-end
    helper, those of the real-swift and Slurm suites, and the modules listed above."""
    for item in items:
        module = item.module
        helpers = {getattr(v, "__module__", None) for v in vars(module).values()}
        if (module.__name__ in E2E_MODULES or helpers & E2E_HELPERS or item.get_closest_marker("swift")
                or "cluster" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
