"""`orchestrator plan`: the exact command, the recipe hash, a memory estimate and pre-flight checks.

Checks read the filesystem, NVML and a socket; each is a small function returning a Check, so the
same list serves `plan` (print everything) and `run` (refuse to launch on a fatal failure).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from orchestrator import estimate, gpu, storage
from orchestrator.recipe import Recipe, expert_count, read_model_config, recipe_hash
from orchestrator.render.command import render_command
from orchestrator.types import Check, GpuSnapshot

GIB = 1024**3


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def first_free_port(lo: int, hi: int, avoid: set[int] = frozenset()) -> int | None:
    return next((p for p in range(lo, hi + 1) if p not in avoid and port_free(p)), None)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG, EACCES: treat as absent, the check then says what is missing
        return False


def _existing_parent(path: Path) -> Path:
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def check_model(r: Recipe) -> Check:
    d = Path(r.model.path)
    if not _exists(d / "config.json") or not (d / "config.json").is_file():
        return Check("model", False, f"{d}: no config.json (model.path must be a local HF model directory)")
    weights = list(d.glob("*.safetensors"))
    if not weights:
        return Check("model", False, f"{d}: config.json found but no *.safetensors weights")
    return Check("model", True, f"{d}: config.json and {len(weights)} safetensors file(s)")


def check_data(r: Recipe) -> Check:
    local = [p for p in r.data.dataset + r.data.val_dataset if p.startswith("/")]
    missing = [p for p in local if not _exists(Path(p.split("#")[0]))]
    if missing:
        return Check("dataset", False, f"missing: {', '.join(missing)}")
    remote = len(r.data.dataset + r.data.val_dataset) - len(local)
    detail = f"{len(local)} local file(s) found"
    if remote:
        return Check("dataset", False, f"{detail}; {remote} non-local dataset id(s): runs are offline, use local files")
    return Check("dataset", True, detail)


def free_gib(path: str) -> float:
    return shutil.disk_usage(_existing_parent(Path(path))).free / GIB


def check_disk(name: str, path: str | None, need_gib: float) -> Check:
    if path is None:
        return Check(f"disk:{name}", True, "not configured", fatal=False)
    free = free_gib(path)
    return Check(f"disk:{name}", free >= need_gib, f"{path}: {free:.1f} GiB free (want >= {need_gib:g} GiB)")


# --- storage: the budget against the disks -------------------------------------------------------

PROBE_BYTES = 64 << 20


def model_config(r: Recipe) -> tuple[dict | None, int | None]:
    """The model's config.json (else a known published config) and the index's total_size in bytes."""
    total_bytes = None
    try:
        index = json.loads((Path(r.model.path) / "model.safetensors.index.json").read_text())
        total_bytes = int(index["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return read_model_config(r) or estimate.known_config(r.model.path), total_bytes


def mount_point(path: str) -> Path:
    p = _existing_parent(Path(path)).resolve()
    try:
        while p != p.parent and os.stat(p.parent).st_dev == os.stat(p).st_dev:
            p = p.parent
    except OSError:
        pass
    return p


def free_bytes(path: str) -> int:
    return shutil.disk_usage(_existing_parent(Path(path))).free


def held_bytes(directory: str) -> int:
    """Bytes on disk in `directory`'s checkpoint-* entries (partial copies included): space retention
    reuses, so a restarted run is not refused for the checkpoints it already holds. A file hard-linked into
    several copies (published copies share unchanged files) counts once."""
    seen: dict[tuple[int, int], int] = {}
    try:
        entries = [e for e in os.scandir(directory) if "checkpoint-" in e.name]
    except OSError:
        return 0
    for e in entries:
        for root, _dirs, files in os.walk(e.path) if e.is_dir(follow_symlinks=False) else [("", [], [e.path])]:
            for f in files:
                try:
                    st = os.lstat(os.path.join(root, f))
                except OSError:
                    continue
                seen[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def probe_write(directory: str, nbytes: int = PROBE_BYTES) -> tuple[float | None, str]:
    """Write speed of `directory`'s filesystem in bytes/s: `nbytes` of random data written and fsync'd to a
    hidden file in the nearest existing parent, removed afterwards. -> (bytes/s or None, detail)."""
    d = _existing_parent(Path(directory))
    try:
        nbytes = min(nbytes, shutil.disk_usage(d).free // 4)  # never the probe that fills a disk
    except OSError as e:
        return None, f"{d}: cannot stat ({e.strerror or e})"
    if nbytes < 1 << 20:
        return None, f"{d}: less than 4 MiB free, not probed"
    block = os.urandom(1 << 20)  # incompressible: a compressing filesystem must not flatter the number
    path = d / f".orchestrator-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.monotonic()
            for _ in range(nbytes >> 20):
                os.write(fd, block)
            os.fsync(fd)
            elapsed = time.monotonic() - t0
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"{d}: probe write failed ({e.strerror or e})"
    finally:
        path.unlink(missing_ok=True)
    written = (nbytes >> 20) << 20
    return written / max(elapsed, 1e-6), f"{d}: {written >> 20} MiB fsync'd in {elapsed:.2f} s"


def storage_budget(r: Recipe) -> tuple[storage.StorageBudget, dict[str, dict]]:
    """The budget (keep_local defaulting to what output_dir's disk can hold) and each disk's free and held bytes."""
    disks = {name: {"path": path, "free_bytes": free_bytes(path), "held_bytes": held_bytes(path)}
             for name, path in (("output_dir", r.run.output_dir), ("persistent_dir", r.run.persistent_dir)) if path}
    out = disks["output_dir"]
    cfg, total_bytes = model_config(r)
    return storage.budget(r, cfg, total_bytes, out["free_bytes"] + out["held_bytes"]), disks


def check_storage(r: Recipe, b: storage.StorageBudget, disks: dict[str, dict]) -> list[Check]:
    """Fatal when a disk cannot hold what retention keeps there (the trainer would meet ENOSPC mid-run)."""
    c, checks = r.checkpoint, []
    fixes = []
    if c.merge == "every_save":
        fixes.append("set checkpoint.merge = \"final\" (one merged copy after training, not one per save) or \"never\"")
    elif c.merge == "final":
        fixes.append(f"set checkpoint.merge = \"never\" (no {storage.gib(b.final_merged_bytes)} export at the end)")
    if "mcore_shards" in b.per_save_bytes or "optimizer" in b.per_save_bytes:
        fixes.append("set checkpoint.keep_optimizer = false (weights-only resume)")
    keep_local = [f"lower checkpoint.keep_local (now {b.keep_local})"] if b.keep_local > 1 else []
    fixes_for = {"output_dir": [*keep_local, *fixes, "raise checkpoint.save_steps (fewer copies waiting to be published)"],
                 "persistent_dir": [f"lower checkpoint.keep_persistent (now {c.keep_persistent})", *fixes]}
    need = {"output_dir": b.local_bytes, "persistent_dir": b.persistent_bytes}
    per_save = sum(b.per_save_bytes.values())
    for name in ("output_dir", "persistent_dir"):
        d = disks.get(name)
        if d is None:
            checks.append(Check(f"disk:{name}", True, "not configured", fatal=False))
            continue
        avail = d["free_bytes"] + d["held_bytes"]
        held = f" + {storage.gib(d['held_bytes'])} in this run's checkpoints" if d["held_bytes"] else ""
        what = (f"{b.keep_local} kept + 1 being written, {storage.gib(per_save)} per save" if name == "output_dir"
                else f"{c.keep_persistent} newest + the best-loss copy")
        if b.final_merged_bytes:
            what += f"; the final merged export {storage.gib(b.final_merged_bytes)}"
        detail = (f"{d['path']} (disk {mount_point(d['path'])}): retention needs {storage.gib(need[name])} "
                  f"({what}), {storage.gib(d['free_bytes'])} free{held}")
        ok = need[name] <= avail
        checks.append(Check(f"disk:{name}", ok, detail if ok else f"{detail}: does not fit; "
                            f"{'; '.join(fixes_for[name])}; or free space"))
    return checks


def check_publish(r: Recipe, b: storage.StorageBudget, write_bytes_per_s: float | None, probe: str) -> Check:
    """A warning: publishing slower than saves arrive piles unpublished copies up on the local disk."""
    need, speed = b.publish_bytes_per_s, write_bytes_per_s or 0.0
    wrote = f"wrote {speed / 2**20:,.0f} MiB/s" if write_bytes_per_s else f"not measured: {probe}"
    detail = (f"{storage.gib(b.published_per_save_bytes)} per save every {b.save_interval_s / 60:.0f} min "
              f"({r.checkpoint.save_steps} steps x {b.step_time_s:g} s, {b.step_time_source}) needs "
              f"{need / 2**20:,.0f} MiB/s; {r.run.persistent_dir} {wrote}")
    ok = speed >= need
    return Check("publish_throughput", ok, detail if ok else f"{detail}: raise checkpoint.save_steps, set "
                 "checkpoint.merge = \"final\" or \"never\", or use faster persistent storage", fatal=False)


def check_gpus(r: Recipe, snap: GpuSnapshot) -> Check:
    if not r.gpu.check:
        return Check("gpus", True, "GPU checks disabled (gpu.check = false)", fatal=False)
    if snap.error:
        return Check("gpus", False, f"cannot read GPUs: {snap.error} (no NVIDIA driver on this machine? "
                                    "set gpu.check = false for a CPU run)")
    n = len(snap.gpus)
    want = r.parallel.nproc_per_node
    return Check("gpus", n >= want, f"NVML sees {n} GPU(s), recipe needs nproc_per_node = {want}")


def check_port(r: Recipe) -> Check:
    lo, hi = r.supervisor.port_range
    port = first_free_port(lo, hi)
    if port is None:
        return Check("rendezvous_port", False, f"no free port in {lo}-{hi}")
    return Check("rendezvous_port", True, f"{port} free (range {lo}-{hi})")


def check_layout(r: Recipe) -> list[Check]:
    p, o = r.parallel, r.optim
    experts = expert_count(r)
    if experts is None:
        ep = Check("experts_divisible_by_ep", False, "expert count unknown (no config.json; set model.num_experts)", fatal=False)
    else:
        ep = Check("experts_divisible_by_ep", experts % p.expert == 0, f"{experts} experts / EP {p.expert}")
    dp = p.data_parallel
    gbs = Check("global_batch_divisible", o.global_batch_size % (o.micro_batch_size * dp) == 0,
                f"global {o.global_batch_size} / (micro {o.micro_batch_size} x DP {dp})")
    return [ep, gbs]


def preflight(r: Recipe, snap: GpuSnapshot) -> list[Check]:
    return [check_model(r), check_data(r), *check_storage(r, *storage_budget(r)), check_gpus(r, snap), check_port(r),
            *check_layout(r)]


def memory(r: Recipe, snap: GpuSnapshot) -> estimate.MemoryEstimate:
    cfg = read_model_config(r)
    total_bytes = None
    try:
        index = json.loads((Path(r.model.path) / "model.safetensors.index.json").read_text())
        total_bytes = int(index["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cfg = cfg or estimate.known_config(r.model.path)
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


def plan(r: Recipe, reader: gpu.GpuReader | None = None, probe: bool = False) -> dict:
    snap = (reader or gpu.reader(r.gpu.check)).snapshot()
    storage_out, storage_checks = storage_section(r, probe)
    checks = preflight(r, snap) + storage_checks
    lo, _ = r.supervisor.port_range
    cmd = render_command(r, None, first_free_port(*r.supervisor.port_range) or lo)
    return {
        "argv": list(cmd.argv),
        "env": cmd.env,
        "recipe_hash": recipe_hash(r),
        "backend": r.run.backend,
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "fatal": c.fatal} for c in checks],
        "memory": memory(r, snap).as_dict(),
        "storage": storage_out,
    }
