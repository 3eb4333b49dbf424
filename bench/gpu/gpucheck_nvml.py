"""The GPU check's steps about the GPU gate and CUDA's failure text: the orchestrator's NVML reader against
nvidia-smi, a real stale holder that `orchestrator run` refuses to launch past, a holder matching
gpu.kill_patterns killed and the GPU verified clear (timed), and real CUDA OOMs at start-up and after
training steps, each classified by `orchestrator classify`."""
from __future__ import annotations

import json
import signal
import time

import gpucheck_procs as procs
from gpucheck_base import Ctx, Failed, Step, last_json
from gpucheck_procs import Proc
from gpucheck_recipe import gpu_recipe, tiny_info

MIB = 1024**2
GPU0 = [0]
THRESHOLD_MIB = 1024            # gpu.clear_threshold_mib's default
MIB_TOLERANCE = 64              # NVML and nvidia-smi are read a moment apart
HOLD_MIB = 8192                 # a stale holder's share: far over the clear threshold, small for any GPU here
CLEAR_POLL_S = 0.01


def snapshot_dict(snap) -> dict:
    """A GpuSnapshot as JSON-ready data: MiB to compare, bytes to rebuild it exactly (snapshot_of)."""
    return {"error": snap.error, "gpus": [
        {"index": g.index, "name": g.name, "uuid": g.uuid, "total_mib": g.memory_total_bytes // MIB,
         "used_mib": g.memory_used_bytes // MIB, "total_bytes": g.memory_total_bytes,
         "used_bytes": g.memory_used_bytes,
         "processes": [{"pid": p.pid, "used_mib": (p.used_bytes or 0) // MIB, "used_bytes": p.used_bytes}
                       for p in g.processes]}
        for g in snap.gpus]}


def snapshot_of(data: dict):
    """The GpuSnapshot that snapshot_dict() wrote (a recorded reading replayed on CPU)."""
    from orchestrator.types import GpuInfo, GpuProcess, GpuSnapshot

    return GpuSnapshot(error=data["error"], gpus=tuple(
        GpuInfo(g["index"], g["name"], g["total_bytes"], g["used_bytes"],
                tuple(GpuProcess(p["pid"], p["used_bytes"]) for p in g["processes"]), g["uuid"])
        for g in data["gpus"]))


def differences(nvml: dict, smi: list[dict], apps: list[dict]) -> list[str]:
    """Where the orchestrator's NVML reading and nvidia-smi's disagree (empty: they agree)."""
    if nvml["error"]:
        return [f"NVML unreadable: {nvml['error']}"]
    out = []
    if len(nvml["gpus"]) != len(smi):
        out.append(f"NVML sees {len(nvml['gpus'])} GPUs, nvidia-smi {len(smi)}")
    by_uuid = {s["uuid"]: s for s in smi}
    for g in nvml["gpus"]:
        s = by_uuid.get(g["uuid"])
        if s is None:
            out.append(f"GPU {g['index']} {g['uuid']}: not in nvidia-smi's list")
            continue
        if g["name"] != s["name"]:
            out.append(f"GPU {g['index']}: name {g['name']!r} vs nvidia-smi {s['name']!r}")
        for key, smi_key, tol in (("total_mib", "memory.total", 1), ("used_mib", "memory.used", MIB_TOLERANCE)):
            if abs(g[key] - int(s[smi_key])) > tol:
                out.append(f"GPU {g['index']}: {key} {g[key]} vs nvidia-smi {s[smi_key]} MiB")
        mine = {p["pid"]: p["used_mib"] for p in g["processes"]}
        theirs = {int(a["pid"]): int(a["used_memory"]) for a in apps if a["gpu_uuid"] == g["uuid"]}
        if set(mine) != set(theirs):
            out.append(f"GPU {g['index']}: NVML processes {sorted(mine)} vs nvidia-smi {sorted(theirs)}")
        out += [f"GPU {g['index']} pid {pid}: {mine[pid]} vs nvidia-smi {theirs[pid]} MiB"
                for pid in set(mine) & set(theirs) if abs(mine[pid] - theirs[pid]) > MIB_TOLERANCE]
    return out


def reading(ctx: Ctx, label: str) -> dict:
    """The orchestrator's reader, nvidia-smi and the clear verdict at one moment, logged."""
    from orchestrator.host import gpu

    snap = gpu.NvmlReader().snapshot()
    nvml, smi, apps = snapshot_dict(snap), procs.smi_gpus(), procs.smi_apps()
    clear, problems = gpu.clear_verdict(snap, GPU0, THRESHOLD_MIB)
    out = {"nvml": nvml, "nvidia_smi": smi, "nvidia_smi_apps": apps, "clear": clear, "problems": problems,
           "differences": differences(nvml, smi, apps)}
    with open(ctx.log("nvml_vs_smi.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"label": label, **out}) + "\n")
    return out


def holder_argv(ctx: Ctx, tag: str, size: list[str]) -> list[str]:
    """The holder's command line (the tests replace it with one that holds no GPU)."""
    return [ctx.python, str(ctx.here / "holder.py"), "--tag", tag, *size]


def start_holder(ctx: Ctx, tag: str, log: str, hold_mib: int | None = None, leave_mib: int | None = None) -> tuple[Proc, dict]:
    """Start bench/gpu/holder.py and wait until it holds its memory: (process, its JSON line)."""
    size = ["--hold-mib", str(hold_mib)] if hold_mib is not None else ["--leave-mib", str(leave_mib)]
    p = Proc(holder_argv(ctx, tag, size), ctx.log(log), env=ctx.env())
    hit = p.wait_line(r'^\{"pid"', 120)
    if hit is None:
        p.stop(signal.SIGKILL)
        raise Failed(f"the GPU holder did not start:\n{p.text()}")
    return p, json.loads(hit[2])


def time_to_clear(since: float, timeout: float = 30.0) -> float | None:
    """Seconds from `since` (time.monotonic) until the orchestrator's verdict on GPU 0 is clear; None if never.
    Through the reader the supervisor uses (NVML; the tests' stand-in where ORCHESTRATOR_GPU_STANDIN says)."""
    from orchestrator.host import gpu

    reader = gpu.reader(True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gpu.clear_verdict(reader.snapshot(), GPU0, THRESHOLD_MIB)[0]:
            return time.monotonic() - since
        time.sleep(CLEAR_POLL_S)
    return None


def nvml_vs_smi(ctx: Ctx) -> dict:
    """The reader against nvidia-smi idle and with a holder; then the holder's exit timed to "clear"."""
    idle = reading(ctx, "idle")
    holder, held = start_holder(ctx, "gpu-check-nvml-holder", "nvml_holder.log", hold_mib=HOLD_MIB)
    try:
        busy = reading(ctx, "held")
    finally:
        holder.stop(signal.SIGKILL)
    exit_to_clear = time_to_clear(holder.exited_at or time.monotonic())
    after = reading(ctx, "after")
    result = {"idle": idle, "held": busy, "holder": held, "after": after,
              "exit_to_clear_s": None if exit_to_clear is None else round(exit_to_clear, 4)}
    found = [f"idle: {d}" for d in idle["differences"]] + [f"held: {d}" for d in busy["differences"]]
    if not idle["clear"]:
        found.append(f"idle GPU not clear: {idle['problems']}")
    if busy["clear"] or not any(str(held["pid"]) in p for p in busy["problems"]):
        found.append(f"with holder pid {held['pid']} the verdict was {busy['clear']}: {busy['problems']}")
    if exit_to_clear is None:
        found.append("GPU 0 not clear 30 s after the holder's exit")
    if found:
        raise Failed("\n".join(found), result)
    return result


def supervise(ctx: Ctx, recipe, log: str) -> Proc:
    return Proc(ctx.orchestrator("run", str(recipe)), ctx.log(log), env=ctx.env())


def stale_holder_refused(ctx: Ctx) -> dict:
    """A holder no pattern allows: the supervisor stays in VERIFYING, says why, launches nothing."""
    recipe = gpu_recipe(ctx.work / "stale", tiny(ctx), "gpucheck-stale")
    holder, held = start_holder(ctx, "gpu-check-foreign-holder", "stale_holder.log", hold_mib=HOLD_MIB)
    sup = supervise(ctx, recipe, "stale_supervisor.log")
    try:
        first = sup.wait_line(r" gpus_not_clear: ", 120)
        again = sup.wait_line(r" gpus_not_clear: ", 15, since=first[0] + 1) if first else None
        launched = sup.wait_line(r" launch: ", 0.1)
        alive = holder.p.poll() is None
    finally:
        code = sup.stop(signal.SIGTERM, 30)
        holder.stop(signal.SIGKILL)
    result = {"holder": held, "refusal": first and first[2], "refused_again": bool(again),
              "seconds_to_refusal": first and round(first[1] - sup.started, 3), "launched": bool(launched),
              "holder_alive": alive, "supervisor_exit": code}
    if not first:
        raise Failed(f"no gpus_not_clear from `orchestrator run`:\n{sup.text()}", result)
    problems = [p for p, bad in (("it launched the trainer", launched), ("the foreign holder was killed", not alive),
                                 (f"the refusal does not name pid {held['pid']}", str(held["pid"]) not in first[2]))
                if bad]
    if problems:
        raise Failed("; ".join(problems) + f":\n{sup.text()}", result)
    return result


def kill_pattern_holder(ctx: Ctx) -> dict:
    """A holder gpu.kill_patterns allows: killed by the supervisor, GPU verified clear, then the launch."""
    recipe = gpu_recipe(ctx.work / "killpat", tiny(ctx), "gpucheck-killpat", kill_patterns=("gpu-check-stale-trainer",))
    holder, held = start_holder(ctx, "gpu-check-stale-trainer", "killpat_holder.log", hold_mib=HOLD_MIB)
    sup = supervise(ctx, recipe, "killpat_supervisor.log")
    try:
        rc = holder.wait(120)
        exit_to_clear = time_to_clear(holder.exited_at) if rc is not None and holder.exited_at else None
        launch = sup.wait_line(r" launch: ", 120)
        refusal = sup.wait_line(r" gpus_not_clear: ", 0.1)
    finally:
        code = sup.stop(signal.SIGTERM, 30)
        holder.stop(signal.SIGKILL)
    result = {"holder": held, "holder_returncode": rc, "refusal": refusal and refusal[2],
              "exit_to_clear_s": None if exit_to_clear is None else round(exit_to_clear, 4),
              "exit_to_launch_s": round(launch[1] - holder.exited_at, 3) if launch and holder.exited_at else None,
              "launch": launch and launch[2], "supervisor_exit": code}
    if rc is None or not launch:
        raise Failed(("the holder was not killed" if rc is None else "no launch after the holder was killed")
                     + f":\n{sup.text()}", result)
    return result


def classified(ctx: Ctx, log_name: str, text: str, exit_code: int | None, phase: str | None) -> dict:
    """`orchestrator classify` of a captured failure: {"class", "evidence", "phase"}."""
    path = ctx.log(log_name)
    path.write_text(text, encoding="utf-8")
    args = ["classify", str(path), "--json"] + (["--exit-code", str(exit_code)] if exit_code is not None else [])
    rc, out = procs.run_logged(ctx.orchestrator(*args, *(["--phase", phase] if phase else [])),
                               ctx.log("classify.log"), 60, env=ctx.env())
    if rc != 0:
        raise Failed(f"orchestrator classify {path.name} exited {rc}:\n{out}")
    return last_json(out)


def oom_case(ctx: Ctx, name: str, cmd: list[str], want: str, phase: str, timeout: float,
             env: dict[str, str] | None = None) -> dict:
    """Run `cmd`, which should die of a CUDA OOM; classify its output with and without the phase given."""
    rc, text = procs.run_logged(cmd, ctx.log(f"{name}.log"), ctx.timeout(timeout), env=ctx.env(**(env or {})))
    text = text.rsplit("\n[exit ", 1)[0]
    inferred = classified(ctx, f"{name}.txt", text, rc, None)
    told = classified(ctx, f"{name}.txt", text, rc, phase)
    return {"exit_code": rc, "oom": "out of memory" in text.lower(), "class_inferred": inferred["class"],
            "class_with_phase": told["class"], "evidence": inferred["evidence"], "want": want,
            "ok": rc != 0 and inferred["class"] == want and told["class"] == want}


def oom_at_startup(ctx: Ctx) -> dict:
    """Holders keep the memory: a start-up allocation (1 GiB left free) and the real `swift sft` start that
    `orchestrator run` would launch (nothing left free) both run out."""
    result = {}
    holder, held = start_holder(ctx, "gpu-check-oom-holder", "oom_startup_holder.log", leave_mib=1024)
    try:
        result["holder"] = held
        result["weights"] = oom_case(ctx, "oom_startup_weights", [ctx.python, str(ctx.here / "oom_probe.py"),
                                     "startup", "--gib", "4"], "cold_start_oom", "startup", 120)
    finally:
        holder.stop(signal.SIGKILL)
    if ctx.missing("swift") is None:   # the very command `orchestrator run` would launch, and its environment
        plan = cli_json(ctx, "oom_startup_plan.log", "plan",
                        str(gpu_recipe(ctx.work / "oom-swift", tiny(ctx), "gpucheck-oom")), "--no-probe")
        time_to_clear(time.monotonic())
        holder, held = start_holder(ctx, "gpu-check-oom-holder", "oom_startup_holder_all.log", leave_mib=0)
        try:
            result["holder_all"] = held
            result["swift"] = oom_case(ctx, "oom_startup_swift", plan["argv"], "cold_start_oom", "startup", 180,
                                       env=plan["env"])
        finally:
            holder.stop(signal.SIGKILL)
    bad = [k for k in ("weights", "swift") if k in result and not result[k]["ok"]]
    if bad:
        raise Failed(f"not classified cold_start_oom: {', '.join(bad)}: " + json.dumps({k: result[k] for k in bad}),
                     result)
    return result


def oom_after_steps(ctx: Ctx) -> dict:
    """Three steps of training, then a batch the GPU cannot hold: oom_during_training."""
    result = oom_case(ctx, "oom_training", [ctx.python, str(ctx.here / "oom_probe.py"), "training", "--model",
                                            str(tiny(ctx) / "tiny-moe")], "oom_during_training", "training", 240)
    if not result["ok"]:
        raise Failed("not classified oom_during_training: " + json.dumps(result), result)
    return result


def cli_json(ctx: Ctx, log: str, *args: str) -> dict:
    """Run an orchestrator command that answers with --json; its answer."""
    rc, text = procs.run_logged(ctx.orchestrator(*args, "--json"), ctx.log(log), ctx.timeout(120), env=ctx.env())
    if rc not in (0, 2):
        raise Failed(f"orchestrator {' '.join(args)} exited {rc}:\n{text}")
    return last_json(text)


def tiny(ctx: Ctx):
    """The tiny MoE and its data, built once per check (offline, on the device's CPUs)."""
    if "tiny" not in ctx.cache:
        rc, text = procs.run_logged(ctx.orchestrator("build-tiny", str(ctx.work / "tiny")), ctx.log("build_tiny.log"),
                                    ctx.timeout(300), env=ctx.env())
        if rc != 0:
            raise Failed(f"orchestrator build-tiny exited {rc}:\n{text}")
        ctx.cache["tiny"] = ctx.work / "tiny"
        ctx.cache["tiny_info"] = tiny_info(text)
    return ctx.cache["tiny"]


STEPS = [
    Step("nvml_vs_smi", nvml_vs_smi, ("cuda",), 30,
         "the NVML reader agrees with nvidia-smi (memory, processes) and its clear verdict sees a real holder"),
    Step("stale_holder_refused", stale_holder_refused, ("cuda",), 60,
         "a real foreign holder keeps `orchestrator run` in VERIFYING: gpus_not_clear names it, nothing launches"),
    Step("kill_pattern_holder", kill_pattern_holder, ("cuda",), 60,
         "a holder matching gpu.kill_patterns is killed, the GPU verified clear, then launched (timed)"),
    Step("oom_at_startup", oom_at_startup, ("cuda",), 60,
         "real CUDA OOM text at start-up (a holder keeps the memory) is classified cold_start_oom"),
    Step("oom_after_steps", oom_after_steps, ("cuda",), 45,
         "real CUDA OOM text after training steps is classified oom_during_training"),
]
