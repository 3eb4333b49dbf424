"""The checkpoint gate's test world (issue 31): the in-memory host with real checkpoint directories, a real
journal and real sync rounds; faults to put into a checkpoint or a log, and the drivers the gate tests share."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from checkpoint_dirs import make_megatron
from loop_world import OOM, journal
from orchestrator.store import sync
from orchestrator.store.published import publish_dir
from orchestrator.types import State

N = 40
LORA = {"rank": 8, "alpha": 32}   # what checkpoint_dirs writes: the checkpoints verify
NAN_LINE = "{'loss': 'nan', 'grad_norm': 'nan', 'learning_rate': '1e-4', 'global_step/max_steps': '%d/40'}"


def poison(d: Path) -> Path:
    """Puts an Inf into one tensor of the checkpoint's adapter (a save written after training diverged)."""
    f = d / "adapter_model.safetensors"
    t = load_file(str(f))
    name = sorted(t)[0]
    t[name] = t[name].copy()
    t[name][0, 0] = np.inf
    save_file(t, str(f), metadata={"format": "pt"})
    return d


def stale_copy(out: Path, of: int, step: int) -> Path:
    """checkpoint-`step` whose adapter and shards are byte-identical to checkpoint-`of`'s (an async writer's
    stale copy, NeMo-RL #3312)."""
    d = make_megatron(out, step)
    shutil.copy(out / f"checkpoint-{of}" / "adapter_model.safetensors", d / "adapter_model.safetensors")
    shutil.copy(out / f"checkpoint-{of}" / f"iter_{of:07d}" / "__0_0.distcp", d / f"iter_{step:07d}" / "__0_0.distcp")
    return d


def world_with(world, persistent: Path | None = None, **sections):
    run = {"persistent_dir": str(persistent)} if persistent else {}
    return world(optim={"iterations": N}, lora=LORA, run=run, **sections)


def resumed_from(t) -> str | None:
    argv = t.cmd.argv
    return argv[argv.index("--mcore_adapter") + 1] if "--mcore_adapter" in argv else None


def events(sup, kind):
    return [e for e in journal(sup).events(1000) if e["kind"] == kind]


def standing(sup, step) -> str | None:
    return {c["step"]: c.get("standing") for c in journal(sup).checkpoints()}.get(step)


def a_pass(sup, host) -> State:
    host.mono += 5   # past the checkpoint scan interval
    return sup.step()


def train_to(sup, host, t, last: int, saves=(10, 20)) -> None:
    for s in saves:
        make_megatron(sup.ctx.out, s)
    t.steps(1, last, N)
    assert a_pass(sup, host) is State.RUNNING
    assert sup.ctx.checkpoints.wait_checks(60)


def kill_after_save(sup, host, t, step: int) -> None:
    """The trainer wrote checkpoint-`step` and was killed one step later (an OOM)."""
    t.steps(step - 1, step + 1, N)
    t.write(OOM)
    t.exit(code=1)
    assert a_pass(sup, host) is State.CRASHED


def published_steps(sup) -> list[int]:
    r = sup.ctx.recipe.run
    d = publish_dir(r.persistent_dir, r.name, sup.hash)
    return sorted(int(p.name.split("-")[1]) for p in d.iterdir() if p.name.startswith("checkpoint-")
                  and p.name.split("-")[1].isdigit())


def publish_now(sup) -> sync.SyncResult:
    """One sync round as the supervisor's thread runs it (its gate), synchronously."""
    r = sup.ctx.recipe
    return sync.sync_once(r.run.output_dir, publish_dir(r.run.persistent_dir, r.run.name, sup.hash), r.run.backend,
                          sup.hash, gate=sup.ctx.standings.publish_refusal, lock_wait_s=30)
