"""The demo recipe pointed at the tiny MoE, for the real-swift end-to-end tests."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config.recipe import load
from supervised import free_port_range

DEMO = Path(__file__).resolve().parents[2] / "orchestrator" / "data" / "demo-cpu.toml"


def recipe(tiny, out: Path, *extra: str):
    lo, hi = free_port_range(20)
    return load(DEMO, [f"model.path={json.dumps(tiny['model'])}", f"data.dataset=[{json.dumps(tiny['data'])}]",
                       f"run.output_dir={json.dumps(str(out / 'out'))}",
                       f"run.persistent_dir={json.dumps(str(out / 'persist'))}",
                       "optim.iterations=30", "checkpoint.save_steps=10", "metrics.listen=\"127.0.0.1:0\"",
                       "metrics.linger_s=0", "supervisor.wait_s=0.5", "supervisor.poll_s=0.1",
                       f"supervisor.port_range=[{lo}, {hi}]",
                       'checkpoint.merge="never"',  # these runs are about training (the export: test_e2e_merge_final)
                       *extra])
