"""Pre-flight: the checks that stop `run` before it launches anything (model, data, storage budget, GPUs,
port, layout, trainer executable, Slurm allocation). Each reads the world a little (files, statvfs, a socket,
NVML through the snapshot it is given) and returns a Check; `plan` prints them all, the supervisor refuses to
launch on a failed fatal one.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from orchestrator.config.model_shape import known_config
from orchestrator.host import gpu
from orchestrator.host.launch import local as launcher, slurm
from orchestrator.domain import policy, storage
from orchestrator.host.probe import exists, first_free_port, free_bytes, held_bytes, mount_point
from orchestrator.config.recipe import Recipe, expert_count, read_model_config
from orchestrator.config.render.command import render_command
from orchestrator.types import GIB, Check, GpuSnapshot


def check_model(r: Recipe) -> Check:
    d = Path(r.model.path)
    if not exists(d / "config.json") or not (d / "config.json").is_file():
        return Check("model", False, f"{d}: no config.json (model.path must be a local HF model directory)")
    weights = list(d.glob("*.safetensors"))
    if not weights:
        return Check("model", False, f"{d}: config.json found but no *.safetensors weights")
    return Check("model", True, f"{d}: config.json and {len(weights)} safetensors file(s)")


def check_data(r: Recipe) -> Check:
    local = [p for p in r.data.dataset + r.data.val_dataset if p.startswith("/")]
    missing = [p for p in local if not exists(Path(p.split("#")[0]))]
    if missing:
        return Check("dataset", False, f"missing: {', '.join(missing)}")
    remote = len(r.data.dataset + r.data.val_dataset) - len(local)
    detail = f"{len(local)} local file(s) found"
    if remote:
        return Check("dataset", False, f"{detail}; {remote} non-local dataset id(s): runs are offline, use local files")
    return Check("dataset", True, detail)


def model_config(r: Recipe) -> tuple[dict | None, int | None]:
    """The model's config.json (else a known published config) and the index's total_size in bytes."""
    total_bytes = None
    try:
        index = json.loads((Path(r.model.path) / "model.safetensors.index.json").read_text())
        total_bytes = int(index["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return read_model_config(r) or known_config(r.model.path), total_bytes


def storage_budget(r: Recipe) -> tuple[storage.StorageBudget, dict[str, dict]]:
    """The budget (keep_local defaulting to what output_dir's disk can hold) and each disk's free and held bytes."""
    disks: dict[str, dict] = {}
    for name, path in (("output_dir", r.run.output_dir), ("persistent_dir", r.run.persistent_dir)):
        if path:
            disks[name] = {"path": path, "free_bytes": free_bytes(path), "held_bytes": held_bytes(path)}
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
    fixes_for = {"output_dir": [*keep_local, *fixes],
                 "persistent_dir": [f"lower checkpoint.keep_persistent (now {c.keep_persistent})", *fixes]}
    need = {"output_dir": b.local_bytes, "persistent_dir": b.persistent_bytes or 0}
    per_save = sum(b.per_save_bytes.values())
    for name in ("output_dir", "persistent_dir"):
        d = disks.get(name)
        if d is None:
            checks.append(Check(f"disk:{name}", True, "not configured", fatal=False))
            continue
        avail = d["free_bytes"] + d["held_bytes"]
        held = f" + {storage.gib(d['held_bytes'])} in this run's checkpoints" if d["held_bytes"] else ""
        publishing = " + 1 being published" if r.run.persistent_dir else ""
        what = (f"{b.keep_local} kept + 1 being written{publishing}, {storage.gib(per_save)} per save"
                if name == "output_dir"
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
    """A warning: publishing slower than its cadence leaves the published copy further behind (what losing
    the node would cost)."""
    need, speed = b.publish_bytes_per_s, write_bytes_per_s or 0.0
    wrote = f"wrote {speed / 2**20:,.0f} MiB/s" if write_bytes_per_s else f"not measured: {probe}"
    cadence = (f"a save every {b.save_interval_s / 60:.0f} min ({round(b.save_interval_s / b.step_time_s)} steps x "
               f"{b.step_time_s:g} s, {b.step_time_source})")
    if b.publish_every_s > b.save_interval_s:
        cadence = f"the newest save every {b.publish_every_s / 60:.0f} min (checkpoint.publish_interval_s)"
    detail = (f"publishing {storage.gib(b.published_per_save_bytes)}, {cadence}, needs {need / 2**20:,.0f} MiB/s; "
              f"{r.run.persistent_dir} {wrote}")
    ok = speed >= need
    return Check("publish_throughput", ok, detail if ok else f"{detail}: raise checkpoint.publish_interval_s, set "
                 "checkpoint.merge = \"final\" or \"never\", or use faster persistent storage", fatal=False)


def check_gpus(r: Recipe, snap: GpuSnapshot) -> Check:
    if not r.gpu.check:
        return Check("gpus", True, "GPU checks disabled (gpu.check = false)", fatal=False)
    if snap.error:
        return Check("gpus", False, f"cannot read GPUs: {snap.error} (no NVIDIA driver on this machine? "
                                    "set gpu.check = false for a CPU run)")
    n = len(snap.gpus)
    want = r.parallel.nproc_per_node
    visible = r.env.vars.get("CUDA_VISIBLE_DEVICES")
    try:
        ids = gpu.run_gpus(want, visible)
    except gpu.GpuSelectionError as e:
        return Check("gpus", False, str(e))
    unmatched = [str(i) for i in ids if len(gpu.find(snap, i)) != 1]
    if visible and unmatched:
        return Check("gpus", False, f"CUDA_VISIBLE_DEVICES={visible}: {', '.join(unmatched)} not among the {n} GPU(s) "
                                    "NVML sees (or not unique): list GPUs as nvidia-smi -L shows them")
    return Check("gpus", n >= want, f"NVML sees {n} GPU(s), recipe needs nproc_per_node = {want}"
                 + (f"; CUDA_VISIBLE_DEVICES selects {len(ids)}" if visible else ""))


def check_port(r: Recipe) -> Check:
    lo, hi = r.supervisor.port_range
    port = first_free_port(lo, hi)
    if port is None:
        return Check("rendezvous_port", False, f"no free port in {lo}-{hi}")
    return Check("rendezvous_port", True, f"{port} free (range {lo}-{hi})")


def check_shm(r: Recipe, shm: str = "/dev/shm") -> Check:
    """Checks that /dev/shm can hold what NCCL's shm transport and DataLoader workers put there (a container's
    64 MiB default kills them with Bus errors). Not fatal: a run without both may never need it."""
    users = [f"{n} {who}" for who, n in (("ranks", r.parallel.nproc_per_node),
                                         ("DataLoader workers", r.data.dataloader_num_workers)) if n > 1]
    try:
        st = os.statvfs(shm)
    except OSError as e:
        return Check("shared_memory", False, f"{shm}: cannot read its size ({e.strerror}); NCCL and DataLoader workers "
                                             "need it", fatal=False)
    total_gib = st.f_blocks * st.f_frsize / GIB
    detail = f"{shm}: {total_gib * 1024:.0f} MiB in all, {st.f_bavail * st.f_frsize / GIB * 1024:.0f} MiB free"
    if not users or total_gib >= policy.SHM_MIN_GIB:
        return Check("shared_memory", True, detail, fatal=False)
    return Check("shared_memory", False, f"{detail}: too small for {' and '.join(users)} "
                                         f"(at least {policy.SHM_MIN_GIB:g} GiB); {policy.SHM_FIX}", fatal=False)


def check_slurm(r: Recipe, environ=os.environ) -> list[Check]:
    """parallel.nnodes > 1 runs as a Slurm job step: only inside an allocation (docs/slurm.md).
    One node: no check (today's plan, unchanged)."""
    n = r.parallel.nnodes
    if n <= 1:
        return []
    if not environ.get("SLURM_JOB_ID"):
        return [Check("nodes", False, f"parallel.nnodes = {n} needs a Slurm allocation, and SLURM_JOB_ID is not set: "
                                     f"submit with `orchestrator sbatch RECIPE`, or run inside `salloc --nodes={n}`")]
    return [Check("nodes", True, f"{n} nodes of Slurm job {environ['SLURM_JOB_ID']}"), check_shared_output(r, environ)]


def check_shared_output(r: Recipe, environ=os.environ) -> Check:
    """The journal, checkpoints and run lock live in run.output_dir: every node of the step must see it as this
    one does (checked from every node in one srun step). Not there yet: its nearest existing parent."""
    where = Path(r.run.output_dir).resolve()
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        alloc = slurm.allocation(environ.get("SLURM_JOB_ID"))
    except slurm.SlurmError as e:
        return Check("output_dir_on_every_node", False, f"cannot list the allocation's nodes: {e}")
    nodes = alloc.nodes[:r.parallel.nnodes]
    bad = slurm.node_dir_check(alloc, r.parallel.nnodes, where)
    if not bad:
        return Check("output_dir_on_every_node", True, f"{where} seen and writable from {', '.join(nodes)}")
    return Check("output_dir_on_every_node", False, "; ".join(f"{n}: {'; '.join(p)}" for n, p in bad.items())
                 + f" — run.output_dir ({where}) must be on a filesystem every node mounts at the same path")


def check_trainer(r: Recipe) -> Check:
    """argv[0] of the rendered command exists and is executable, found as the launch will find it
    (else the launch fails with no exit status to classify, and a restart fails the same way)."""
    cmd = render_command(r, None, r.supervisor.port_range[0], save_steps=1)  # argv[0] is all this reads
    name = cmd.argv[0]
    exe = launcher.locate(name, cmd.env.get("PATH", os.environ.get("PATH")), r.run.output_dir)
    if exe:
        return Check("trainer", True, exe if exe == name else f"{name} -> {exe}")
    where = f"run.entrypoint[0] = {name!r}" if r.run.entrypoint else f"{name!r} (the {r.run.backend} trainer)"
    fix = ("give an existing executable (an absolute path, or a name on PATH)" if r.run.entrypoint else
           "install ms-swift into this environment, or set run.entrypoint")
    looked = "no executable file at that path" if os.sep in name else f"not found on PATH or next to {sys.executable}"
    return Check("trainer", False, f"{where}: {looked}; {fix}")


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


def checks(r: Recipe, snap: GpuSnapshot) -> list[Check]:
    return [check_model(r), check_data(r), *check_storage(r, *storage_budget(r)), check_gpus(r, snap), check_port(r),
            *check_layout(r), check_trainer(r), check_shm(r), *check_slurm(r)]


def stoppers(checks: list[Check]) -> list[Check]:
    """The failed checks that stop `run` before it launches anything (the supervisor's pre-flight uses this)."""
    return [c for c in checks if not c.ok and c.fatal]
