"""`orchestrator plan`: the exact command, the recipe hash, memory and storage budgets, the save interval it
would start with, and the pre-flight checks (preflight.py, the same list `run` refuses to launch on)."""
from __future__ import annotations

from orchestrator.config import estimate
from orchestrator.host import gpu
from orchestrator.domain import interval, storage
from orchestrator.host.probe import first_free_port, probe_write
from orchestrator.host.node_history import NodeHistory
from orchestrator import preflight
from orchestrator.preflight import GIB, check_publish, model_config, stoppers, storage_budget
from orchestrator.config.recipe import Recipe, recipe_hash
from orchestrator.config.render.command import render_command
from orchestrator.store.rundir import run_id
from orchestrator.types import Check, GpuSnapshot

def memory(r: Recipe, snap: GpuSnapshot) -> estimate.MemoryEstimate:
    cfg, total_bytes = model_config(r)
    shape = estimate.shape_from_config(cfg, total_bytes) if cfg else None
    capacity = snap.gpus[0].memory_total_bytes / GIB if snap.gpus else r.gpu.capacity_gib
    return estimate.estimate(r, shape, capacity)


def storage_section(r: Recipe, probe: bool) -> tuple[dict, list[Check]]:
    """The budget for `plan`, with each disk's free bytes and, probed, its write speed and seconds per save."""
    b, disks = storage_budget(r)
    out, checks = b.as_dict(), []
    write = {"output_dir": sum(b.per_save_bytes.values()), "persistent_dir": b.published_per_save_bytes}
    for name, d in disks.items():
        speed, d["probe"] = probe_write(d["path"]) if probe else (None, "not probed (--no-probe)")
        d["write_bytes_per_s"] = speed
        d["seconds_per_save"] = write[name] / speed if speed else None
    if probe and "persistent_dir" in disks:
        d = disks["persistent_dir"]
        checks.append(check_publish(r, b, d["write_bytes_per_s"], d["probe"]))
    out["disks"] = disks
    return out, checks


def save_interval(r: Recipe, storage_out: dict) -> dict:
    """The interval a first launch uses and why: the recipe's number, or for "auto" the Young/Daly choice from the
    prior save cost (bytes per save at the probed output_dir write speed, else the default), the step time of
    the storage budget and the failures of earlier runs on this node (node_history.py)."""
    speed = storage_out["disks"]["output_dir"].get("write_bytes_per_s")
    parts = storage_out["per_save_bytes"]
    auto = interval.choose(interval.evidence(
        [], NodeHistory().others(run_id(r.run.output_dir)), sum(parts.values()), speed,
        storage_out["step_time_s"], storage_out["step_time_source"], 0.0, storage.background_bytes(r, parts),
        storage.ranks(r)))
    if r.checkpoint.save_steps == "auto":
        return {"mode": "auto", "steps": auto.steps, "reason": auto.reason, "auto": auto.as_dict()}
    return {"mode": "fixed", "steps": r.checkpoint.save_steps,
            "reason": f"checkpoint.save_steps = {r.checkpoint.save_steps} (fixed); \"auto\" would start with "
                      f"{auto.steps}: {auto.reason}", "auto": auto.as_dict()}


def plan(r: Recipe, reader: gpu.GpuReader | None = None, probe: bool = False) -> dict:
    snap = (reader or gpu.reader(r.gpu.check)).snapshot()
    storage_out, storage_checks = storage_section(r, probe)
    checks = preflight.checks(r, snap) + storage_checks
    lo, _ = r.supervisor.port_range
    chosen = save_interval(r, storage_out)
    cmd = render_command(r, None, first_free_port(*r.supervisor.port_range) or lo, chosen["steps"])
    return {
        "argv": list(cmd.argv),
        "env": cmd.env,
        "recipe_hash": recipe_hash(r),
        "backend": r.run.backend,
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "fatal": c.fatal} for c in checks],
        "memory": memory(r, snap).as_dict(),
        "would_run": not stoppers(checks),
        "storage": storage_out,
        "save_interval": chosen,
    }
