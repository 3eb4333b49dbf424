"""The GPU check's training steps: a supervised real `swift sft` of the tiny MoE on the GPU with a SIGKILL
mid-run and a verified resume; fla's chunked gated delta rule run out of memory in its backward; and
`megatron sft` of the tiny MoE with whatever megatron-core finds there (TransformerEngine or not)."""
from __future__ import annotations

import json
import signal
import threading
import time
from typing import Self

import gpucheck_procs as procs
from gpucheck_base import Ctx, Failed, Step, last_json
from gpucheck_nvml import classified, cli_json, tiny
from gpucheck_recipe import GPU_SETS, gpu_recipe

MIB = 1024**2
CRASH_AT = 15          # the demo's SIGKILL step (of 40, saves every 10)


class GpuSampler:
    """Samples the orchestrator's NVML reading of GPU 0 while a run goes on: the pids seen and the peak."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib = every_s, 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def _run(self) -> None:
        from orchestrator.host import gpu

        reader = gpu.NvmlReader()
        while not self._stop.wait(self.every_s):
            snap = reader.snapshot()
            for g in snap.gpus[:1]:
                self.pids |= {p.pid for p in g.processes}
                self.peak_mib = max(self.peak_mib, g.memory_used_bytes // MIB)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def swift_sft_resume(ctx: Ctx) -> dict:
    """`orchestrator demo` on GPU 0 in bf16: SIGKILL at step 15, resume from the newest verified checkpoint,
    complete, export; then history, status and verify read what it left, as on CPU."""
    t = tiny(ctx)
    sets = [a for s in GPU_SETS for a in ("--set", s)]
    with GpuSampler() as gpu_seen:
        rc, text = procs.run_logged(ctx.orchestrator("demo", "--workdir", str(t), "--crash-at", str(CRASH_AT), *sets),
                                    ctx.log("swift_sft_resume.log"), ctx.timeout(360, floor_s=60),
                                    env=ctx.env())
    return judge_swift_run(ctx, t, rc, text, gpu_seen.pids, gpu_seen.peak_mib)


def judge_swift_run(ctx: Ctx, t, rc: int, text: str, gpu_pids: set[int], peak_mib: int) -> dict:
    """Read what the demo run left (history, status, verify of the newest checkpoint) and judge it."""
    recipe = str(t / "demo-cpu.toml")
    history = cli_json(ctx, "swift_history.log", "history", recipe)
    status = cli_json(ctx, "swift_status.log", "status", recipe)
    newest = (status.get("last_checkpoint") or {}).get("path")
    verified = cli_json(ctx, "swift_verify.log", "verify", newest) if newest else None
    train = [a for a in history["attempts"] if a.get("kind", "train") == "train"]
    result = {"exit_code": rc, "attempts": history["attempts"], "state": status.get("state"),
              "step": status.get("step"), "max_steps": status.get("max_steps"), "goodput": history.get("goodput"),
              "last_checkpoint": status.get("last_checkpoint"), "verify": verified,
              "gpu_pids_seen": sorted(gpu_pids), "gpu_peak_used_mib": peak_mib}
    found = []
    if rc != 0:
        found.append(f"orchestrator demo exited {rc}")
    if len(train) < 2 or train[0].get("class") != "host_oom_killed":
        found.append(f"expected a SIGKILLed first attempt (host_oom_killed) and a relaunch: {train}")
    elif not train[1].get("resumed_from"):
        found.append(f"the relaunch did not resume from a checkpoint: {train[1]}")
    if status.get("step") != status.get("max_steps"):
        found.append(f"ended at step {status.get('step')} of {status.get('max_steps')}")
    if not verified or not verified.get("ok"):
        found.append(f"the newest checkpoint did not verify: {verified}")
    if not gpu_pids:
        found.append("no process was ever seen on GPU 0: the trainer did not use the GPU")
    if found:
        raise Failed("\n".join(found) + f"\n{text[-3000:]}", result)
    return result


def fla_backward_oom(ctx: Ctx) -> dict:
    """fla's chunked gated delta rule forward + backward, then capped so the backward runs out inside fla."""
    rc, text = procs.run_logged([ctx.python, str(ctx.here / "oom_probe.py"), "fla"], ctx.log("fla_oom.log"),
                                ctx.timeout(300), env=ctx.env())
    text = text.rsplit("\n[exit ", 1)[0]
    verdict = classified(ctx, "fla_oom.txt", text, rc, None)
    runs = [json.loads(line) for line in text.splitlines() if line.startswith('{"tokens"')]
    result = {"exit_code": rc, "runs": runs, "class": verdict["class"], "evidence": verdict["evidence"],
              "oom_in_fla_ops": "fla/ops/" in text and "out of memory" in text.lower()}
    if rc == 0 or verdict["class"] != "fla_backward_oom":
        raise Failed(f"expected an OOM classified fla_backward_oom, got exit {rc}, {verdict['class']}:\n"
                     f"{text[-3000:]}", result)
    return result


PROBE = ("import importlib, json\nout = {}\n"
         "for m in ('megatron.core', 'transformer_engine', 'mcore_bridge', 'apex'):\n"
         "    try:\n        mod = importlib.import_module(m)\n"
         "        out[m] = getattr(mod, '__version__', 'imported')\n"
         "    except Exception as e:\n        out[m] = f'{type(e).__name__}: {e}'[:300]\n"
         "print(json.dumps(out))\n")


def megatron_sft(ctx: Ctx) -> dict:
    """What megatron-core does here: which of its pieces import, and a supervised `megatron sft` of the tiny
    MoE (10 iterations) with what it found; the outcome is the finding either way."""
    rc, text = procs.run_logged([ctx.python, "-c", PROBE], ctx.log("megatron_probe.log"), ctx.timeout(120),
                                env=ctx.env())
    imports = last_json(text) if rc == 0 else {"error": text[-2000:]}
    recipe = gpu_recipe(ctx.work / "megatron", tiny(ctx), "gpucheck-megatron", run={"backend": "megatron"},
                        optim={"iterations": 10, "global_batch_size": 4}, checkpoint={"save_steps": 5, "merge": "never"},
                        supervisor={"max_relaunches_without_progress": 1, "startup_timeout_s": 240},
                        replace={"extra_args": {}})
    t0 = time.monotonic()
    sup = procs.Proc(ctx.orchestrator("run", str(recipe)), ctx.log("megatron_supervisor.log"), env=ctx.env())
    code = sup.wait(ctx.timeout(200))
    if code is None:
        code = sup.stop(signal.SIGTERM, 30)
    try:
        history = cli_json(ctx, "megatron_history.log", "history", str(recipe))
    except Failed:   # no journal: it stopped before PREFLIGHT opened one (its output says why)
        history = {"attempts": [], "state": None}
    attempts = history["attempts"]
    result = {"imports": imports, "supervisor_exit": code, "seconds": round(time.monotonic() - t0, 1),
              "attempts": attempts, "state": history.get("state")}
    if code != 0:
        first = attempts[0] if attempts else {}
        attempt_log = sorted((ctx.work / "megatron" / "out" / ".orchestrator" / "attempts").glob("attempt-*.log"))
        tail = attempt_log[0].read_text(encoding="utf-8", errors="replace")[-3000:] if attempt_log else sup.text()[-3000:]
        raise Failed(f"megatron sft did not complete (supervisor exit {code}; first attempt {first.get('class')}, "
                     f"imports {imports}):\n{tail}", result)
    return result


STEPS = [
    Step("swift_sft_resume", swift_sft_resume, ("cuda", "swift"), 120,
         "a supervised real `swift sft` on the GPU survives a SIGKILL: verified resume, completes, exports"),
    Step("fla_backward_oom", fla_backward_oom, ("cuda", "fla"), 90,
         "a real OOM inside fla/ops/ backward is classified fla_backward_oom"),
    Step("megatron_sft", megatron_sft, ("cuda", "swift", "megatron"), 90,
         "whether `megatron sft` of the tiny MoE runs here (TransformerEngine or not), supervised"),
]
