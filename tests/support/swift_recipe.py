"""The demo recipe pointed at the tiny MoE, for the real-swift end-to-end tests: as a Recipe (`recipe`), or as a
recipe file (`recipe_file`) for the commands a test runs in a subprocess (`orchestrator watch`)."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config.recipe import load
from orchestrator.ops import demo
from supervised import free_port_range

DEMO = Path(__file__).resolve().parents[2] / "orchestrator" / "data" / "demo-cpu.toml"


def overrides(tiny, out: Path, *extra: str) -> list[str]:
    """The --set overrides: the tiny model and data, the run under `out`, fast waits, a port range of its own."""
    lo, hi = free_port_range(20)
    return [f"model.path={json.dumps(tiny['model'])}", f"data.dataset=[{json.dumps(tiny['data'])}]",
            f"run.output_dir={json.dumps(str(out / 'out'))}",
            f"run.persistent_dir={json.dumps(str(out / 'persist'))}",
            "optim.iterations=30", "checkpoint.save_steps=10", "metrics.listen=\"127.0.0.1:0\"",
            "metrics.linger_s=0", "supervisor.wait_s=0.5", "supervisor.poll_s=0.1",
            f"supervisor.port_range=[{lo}, {hi}]",
            'checkpoint.merge="never"',  # these runs are about training (the export: test_e2e_merge_final)
            *extra]


def recipe(tiny, out: Path, *extra: str):
    return load(DEMO, overrides(tiny, out, *extra))


def recipe_file(tiny, out: Path, *extra: str) -> Path:
    """The same recipe written to out/demo-cpu.toml."""
    out.mkdir(parents=True, exist_ok=True)
    return demo.write_recipe(DEMO, out, tuple(overrides(tiny, out, *extra)))
