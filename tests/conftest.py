"""Shared fixtures: a valid minimal megatron recipe on disk, with a tiny model dir and a dataset file."""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
DROP = object()  # write_recipe(..., optim={"iterations": DROP}) removes the key

# 8 GPUs, EP 8 over a 16-expert model, DP 8, global batch 16.
MINIMAL = {
    "run": {"name": "t", "backend": "megatron", "output_dir": "out"},
    "model": {"path": "model"},
    "data": {"dataset": ["data.jsonl"]},
    "parallel": {"nproc_per_node": 8, "expert": 8},
    "optim": {"lr": 1e-4, "iterations": 10},
}
MODEL_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                "vocab_size": 1000, "num_experts": 16, "moe_intermediate_size": 32,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if v is DROP:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def to_toml(data: dict) -> str:
    """Just enough TOML for recipes: top-level tables of scalars / lists, one level of sub-tables."""
    def emit(prefix: str, table: dict) -> list[str]:
        lines, subs = [f"[{prefix}]"], []
        for k, v in table.items():
            if isinstance(v, dict):
                subs += emit(f"{prefix}.{k}", v)
            else:
                lines.append(f"{k} = {json.dumps(v)}")
        return lines + [""] + subs
    scalars = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [line for k, v in data.items() if isinstance(v, dict) for line in emit(k, v)]
    return "\n".join(scalars + tables)

def make_model(directory: Path, config: dict | None = MODEL_CONFIG, weights: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if weights:
        (directory / "model.safetensors").write_bytes(b"\0" * 8)
    return directory


def write_recipe(directory: Path, /, name: str = "recipe.toml", *, base: dict = MINIMAL, **sections) -> Path:
    """The one recipe writer of the tests: `base` with `sections` deep-merged in, as TOML in
    `directory`, beside the tiny model directory and the dataset file its relative paths name."""
    make_model(directory / "model")
    (directory / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    path = directory / name
    path.write_text(to_toml(merge(base, sections)))
    return path


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
