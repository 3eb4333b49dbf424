"""The tests' recipe writer: a valid minimal megatron recipe on disk, beside a tiny model directory and a
dataset file."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


DROP = object()  # write_recipe(..., optim={"iterations": DROP}) removes the key


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
