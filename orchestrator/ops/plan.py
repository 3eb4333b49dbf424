"""`orchestrator plan`: the exact command, the recipe hash, memory and storage budgets, the save interval it
would start with, and the pre-flight checks (preflight.py, the same list `run` refuses to launch on); and
what `orchestrator simulate` takes from a recipe."""
from __future__ import annotations

import shlex
from pathlib import Path

from orchestrator.config import estimate
from orchestrator.config.model_shape import shape_from_config
from orchestrator.host import gpu
from orchestrator.domain import interval, storage
from orchestrator.host.probe import first_free_port, probe_write
from orchestrator.host.node_history import NodeHistory
from orchestrator.loop import preflight
from orchestrator.loop.preflight import check_publish, model_config, stoppers, storage_budget
from orchestrator.config.recipe import Recipe, recipe_hash
from orchestrator.config.render.command import render_command
from orchestrator.store.rundir import run_id
from orchestrator.types import GIB, Check, GpuSnapshot


def memory(r: Recipe, snap: GpuSnapshot) -> estimate.MemoryEstimate:
    cfg, total_bytes = model_config(r)
    shape = shape_from_config(cfg, total_bytes) if cfg else None
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


def plan_text(p: dict, recipe: Path) -> str:
    """`plan` as text: shell lines to run the command by hand, then every budget and check as comments."""
    m = p["memory"]
    cap = f" of {m['capacity_gib']:.1f} GiB, margin {m['margin_gib']:.1f} GiB" if m["capacity_gib"] else ""
    lines = ["# environment", *(f"export {k}={shlex.quote(v)}" for k, v in p["env"].items()),
             "# command", shlex.join(p["argv"]), f"# recipe hash {p['recipe_hash']}",
             f"# memory per GPU ~{m['total_gib']:.1f} GiB{cap}:",
             *(f"#   {t['name']:<22} {t['gib']:7.2f} GiB  {t['detail']}" for t in m["terms"]),
             *(f"#   note: {note}" for note in m["notes"]),
             *storage_text(p["storage"])]
    si = p["save_interval"]
    lines.append(f"# save interval: {si['steps']} steps ({si['mode']}): {si['reason']}")
    lines.append("# pre-flight checks")
    lines += [f"  [{'ok' if c['ok'] else 'NOT OK'}] {c['name']}: {c['detail']}" for c in p["checks"]]
    failed = [c["name"] for c in p["checks"] if not c["ok"] and c["fatal"]]
    lines.append(f"run would stop at pre-flight: {', '.join(failed)} failed (fix, then plan again)" if failed
                 else f"run would start: `orchestrator run {shlex.quote(str(recipe))}`")
    return "\n".join(lines)


def storage_text(s: dict) -> list[str]:
    gib = storage.gib
    parts = ", ".join(f"{k} {gib(v)}" for k, v in s["per_save_bytes"].items())
    lines = [f"# storage per save {gib(sum(s['per_save_bytes'].values()))}: {parts}"]
    if s["final_merged_bytes"]:
        lines.append(f"#   merged model after the last step (checkpoint.merge = \"final\"): {gib(s['final_merged_bytes'])}")
    published = s["persistent_bytes"] is not None
    lines.append(f"#   output_dir needs {gib(s['local_bytes'])}: keep_local {s['keep_local']} ({s['keep_local_source']}) "
                 "+ 1 being written" + (" + 1 being published" if published else "")
                 + ("; then the merged export" if s["final_merged_bytes"] else ""))
    if published:
        held = " (checkpoint.publish_interval_s)" if s["publish_every_s"] > s["save_interval_s"] else ""
        lines.append(f"#   persistent_dir needs {gib(s['persistent_bytes'])}; publishing {gib(s['published_per_save_bytes'])} "
                     f"every {s['publish_every_s'] / 60:.0f} min{held} needs {s['publish_bytes_per_s'] / 2**20:,.0f} MiB/s; "
                     f"a save every {s['save_interval_s'] / 60:.0f} min (step {s['step_time_s']:g} s: {s['step_time_source']})")
    for name, d in s["disks"].items():
        speed = f"writes {d['write_bytes_per_s'] / 2**20:,.0f} MiB/s, {d['seconds_per_save']:,.0f} s per save" \
            if d["write_bytes_per_s"] else d["probe"]
        lines.append(f"#   {name} {d['path']}: {gib(d['free_bytes'])} free; {speed}")
    return lines + [f"#   note: {note}" for note in s["notes"]]


def simulate_inputs(r: Recipe) -> dict:
    """`simulate RECIPE`: save bytes from the recipe's storage budget; the plain loop's from the same recipe with
    the field's merged copy at every save."""
    cfg, total = model_config(r)
    own = storage.budget(r, cfg, total)
    field = storage.budget(r.model_copy(update={"checkpoint": r.checkpoint.model_copy(update={"merge": "every_save"})}),
                           cfg, total)
    total_save = sum(own.per_save_bytes.values())
    return {"orch_save_bytes": total_save, "orch_sync_bytes": total_save - storage.background_bytes(r, own.per_save_bytes),
            "async_save": r.checkpoint.async_save, "ranks": storage.ranks(r),
            "orch_final_bytes": own.final_merged_bytes,
            "plain_save_bytes": sum(field.per_save_bytes.values()), "source": f"storage budget of {r.run.name}",
            "recipe_save_steps": r.checkpoint.save_steps}
