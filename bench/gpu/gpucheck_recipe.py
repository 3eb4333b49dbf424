"""The GPU check's training inputs: the tiny MoE and its data (built on the device, offline), and recipes
that run it supervised on GPU 0: the CPU demo's recipe with the GPU switched on."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGED = REPO / "orchestrator" / "data" / "demo-cpu.toml"

# The demo recipe's CPU settings turned to GPU 0 in bf16, with short waits; `orchestrator demo --set`
# takes these as they are (tests/test_gpu_check.py loads them on a machine without a GPU).
GPU_SETS = ('model.torch_dtype="bfloat16"', 'env.vars.CUDA_VISIBLE_DEVICES="0"', "gpu.check=true",
            "extra_args.use_cpu=false", "extra_args.bf16=true", 'metrics.listen="127.0.0.1:0"', "metrics.linger_s=0",
            "supervisor.min_free_gib=1")


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in, tables key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gpu_recipe(dest: Path, tiny: Path, name: str, kill_patterns: tuple[str, ...] = (), replace: dict | None = None,
               **sections: dict) -> Path:
    """Write a recipe that trains the tiny MoE (built in `tiny`) supervised on GPU 0 under `dest`; the
    keyword tables are merged in last, `replace`'s tables replace whole ones. Returns its path."""
    # Imported here, not at the top: the runner must start (and say what is missing) without pydantic too.
    from orchestrator.ops.demo import to_toml

    data = tomllib.loads(PACKAGED.read_text(encoding="utf-8"))
    gpu = {
        "run": {"name": name, "output_dir": str(dest / "out"), "persistent_dir": str(dest / "persistent")},
        "model": {"path": str(tiny / "tiny-moe"), "torch_dtype": "bfloat16"},
        "data": {"dataset": [str(tiny / "data.jsonl")]},
        "env": {"vars": {"CUDA_VISIBLE_DEVICES": "0"}},
        "gpu": {"check": True, "kill_patterns": list(kill_patterns)},
        "extra_args": {"use_cpu": False, "bf16": True, "fp16": False},
        "metrics": {"listen": "127.0.0.1:0", "linger_s": 0},
        "supervisor": {"wait_s": 1, "force_wait_s": 1, "backoff_max_s": 2, "min_free_gib": 1},
    }
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}.toml"
    path.write_text(f"# Written by bench/gpu for the GPU check.\n{to_toml(merge(merge(data, gpu), sections) | (replace or {}))}",
                    encoding="utf-8")
    return path


def tiny_info(text: str) -> dict:
    """Parse `orchestrator build-tiny`'s JSON line."""
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))
