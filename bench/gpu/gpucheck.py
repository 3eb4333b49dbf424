"""The GPU check's runner: the steps in order, most valuable first, each recorded in $OUT/summary.json as
"ran", "skipped: why" or "failed: output", with its raw logs in $OUT/logs.tar.gz.

    python3 bench/gpu/gpucheck.py --out DIR [--work DIR] [--budget-s 420] [--only NAME ...]

bench/gpu/check.sh is the entry on the device (it installs the carried wheels first). A step that needs
what is not there (a CUDA device, ms-swift, fla, megatron-core) is skipped with the reason; so is one that
no longer fits the time budget. Runs on a machine without a GPU too: what needs none runs, the rest says
why not. Exit 0 when no step failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tarfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import gpucheck_procs as procs
from gpucheck_base import Ctx, Failed, Skip, Step, last_json

SUMMARY = "summary.json"
LOGS_TAR = "logs.tar.gz"
LOG_CAP_BYTES = 4 << 20        # a log's tail kept in the tarball (the device returns at most 16 MiB a file)
OUTPUT_TAIL = 2000             # characters of output in a "failed: ..." status
PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "trl", "datasets", "modelscope", "ms-swift",
            "pydantic", "pydantic-core", "nvidia-ml-py", "psutil", "flash-linear-attention", "fla-core",
            "megatron-core", "mcore-bridge", "transformer-engine", "numpy", "safetensors", "tokenizers")


# ------------------------------------------------------------------------------------------ the runner

def status_of(outcome: str, detail: str = "") -> str:
    """The step's status string: "ran", "skipped: why" or "failed: output" (a long output keeps its first
    line, the finding, and its tail)."""
    if outcome == "ran":
        return outcome
    detail = detail.strip() or "(no output)"
    if len(detail) > OUTPUT_TAIL:
        first = detail.splitlines()[0][:300]
        detail = f"{first}\n[...]\n{detail[-(OUTPUT_TAIL - len(first)):]}"
    return f"{outcome}: {detail}"


def run_step(step: Step, ctx: Ctx) -> dict:
    """Run one step: its summary row {"name", "status", "seconds", "proves", "result"}."""
    row: dict = {"name": step.name, "proves": step.proves, "result": {}}
    t0 = time.monotonic()
    why = next((w for n in step.needs if (w := ctx.missing(n))), None)
    if why is None and ctx.left_s() < step.est_s:
        why = f"time budget: {ctx.left_s():.0f} s left of {ctx.budget_s:.0f} s, the step takes ~{step.est_s:.0f} s"
    if why is not None:
        row["status"] = status_of("skipped", why)
    else:
        try:
            row["result"] = step.run(ctx)
            row["status"] = status_of("ran")
        except Skip as e:
            row["status"] = status_of("skipped", str(e))
        except Failed as e:
            row["result"] = e.result
            row["status"] = status_of("failed", str(e))
        except Exception:  # noqa: BLE001 - a bug or a surprise in a step is its failure, the output says which
            row["status"] = status_of("failed", traceback.format_exc())
    row["seconds"] = round(time.monotonic() - t0, 3)
    return row


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` whole or not at all (a call cut off mid-write leaves the previous one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def pack_logs(logs: Path, dest: Path) -> None:
    """Put every log under `logs` into one tarball (the device returns 8 files at most), each log's tail."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(logs.rglob("*")):
            if p.is_file():
                if p.stat().st_size > LOG_CAP_BYTES:
                    with open(p, "rb") as f:
                        f.seek(-LOG_CAP_BYTES, os.SEEK_END)
                        tail = f.read()
                    p.write_bytes(b"[... cut: the last %d bytes follow]\n" % LOG_CAP_BYTES + tail)
                tar.add(p, arcname=f"logs/{p.relative_to(logs)}")
    tmp.replace(dest)


def run_all(steps: list[Step], ctx: Ctx, say=print) -> dict:
    """Run `steps` in order, rewriting the summary and the logs' tarball after each."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    summary: dict = {"check": "bench/gpu", "started_at": time.time(), "budget_s": ctx.budget_s,
                     "host": platform.node(), "steps": []}
    for step in steps:
        say(f"--- {step.name} ...")
        row = run_step(step, ctx)
        summary["steps"].append(row)
        if step.name == "environment" and row["status"] == "ran":
            summary["device"] = row["result"].get("device")
        summary["counts"] = counts(summary["steps"])
        write_json(ctx.out / SUMMARY, summary)
        pack_logs(ctx.logs, ctx.out / LOGS_TAR)   # after every step: a call cut off still returns them
        say(f"    {row['status'].splitlines()[0][:160]} ({row['seconds']:.1f} s)")
    summary["ended_at"] = time.time()
    write_json(ctx.out / SUMMARY, summary)
    pack_logs(ctx.logs, ctx.out / LOGS_TAR)
    say(table(summary))
    return summary


def counts(rows: list[dict]) -> dict[str, int]:
    """How many steps ran, were skipped, failed."""
    out = {"ran": 0, "skipped": 0, "failed": 0}
    for r in rows:
        out[r["status"].split(":", 1)[0]] += 1
    return out


def table(summary: dict) -> str:
    """The summary as a short table (the device tool returns the end of the output)."""
    lines = [f"{'step':<22} {'s':>6}  status"]
    for r in summary["steps"]:
        lines.append(f"{r['name']:<22} {r['seconds']:>6.1f}  {r['status'].splitlines()[0][:100]}")
    c = summary.get("counts", {})
    lines.append(f"ran {c.get('ran', 0)}, skipped {c.get('skipped', 0)}, failed {c.get('failed', 0)}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ steps without a GPU

def environment(ctx: Ctx) -> dict:
    """Record the machine, the driver and the versions that matter (the fixtures' provenance)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device: dict = {"cuda": ctx.missing("cuda") is None}
    if device["cuda"]:
        gpus = procs.smi_gpus()
        device |= {"gpus": [g["name"] for g in gpus], "driver": gpus[0]["driver_version"] if gpus else None,
                   "memory_total_mib": [int(g["memory.total"]) for g in gpus]}
        ctx.log("nvidia-smi-q.txt").write_text(procs.smi(["-q"]), encoding="utf-8")
        header = procs.smi([])
        ctx.log("nvidia-smi.txt").write_text(header, encoding="utf-8")
        device["cuda_version"] = next((w.split("CUDA Version:")[1].split("|")[0].strip()
                                       for w in header.splitlines() if "CUDA Version:" in w), None)
    return {"device": device, "python": sys.version.split()[0], "executable": sys.executable,
            "platform": platform.platform(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "versions": versions, "orchestrator_source": str(REPO)}


def install(ctx: Ctx) -> dict:
    """Report check.sh's install of the carried wheels (it runs before Python starts)."""
    rc_file, log = ctx.work / "install.rc", ctx.log("install.log")
    if not rc_file.exists():
        raise Skip("no carried wheels (.gpu-wheels/ absent: run bench/gpu/prepare.py here and name the folder "
                   "in the run call's carry)")
    rc = int(rc_file.read_text().strip() or "1")
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    if rc != 0:
        raise Failed(f"pip install of the carried wheels exited {rc}:\n{text}")
    return {"wheels": int((ctx.work / "install.count").read_text().strip() or 0)
            if (ctx.work / "install.count").exists() else None}


COLD_START_OOM = """\
[INFO:swift] Loading the model using model_dir: /models/tiny
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/transformers/modeling_utils.py", line 4312, in from_pretrained
    model = cls(config, *model_args, **model_kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB \
of which 1.06 GiB is free. Process 4242 has 78.11 GiB memory in use.
"""


def orchestrator_cli(ctx: Ctx) -> dict:
    """The orchestrator runs from the travelled source with the carried packages: its CLI classifies a log."""
    sample = ctx.log("cli-sample-oom.log")
    sample.write_text(COLD_START_OOM, encoding="utf-8")
    rc, text = procs.run_logged(ctx.orchestrator("classify", str(sample), "--json"), ctx.log("orchestrator_cli.log"),
                                120, env=ctx.env())
    if rc != 0:
        raise Failed(f"orchestrator classify exited {rc}:\n{text}")
    verdict = last_json(text)
    if verdict["class"] != "cold_start_oom":
        raise Failed(f"the sample start-up OOM was classified {verdict['class']}", {"verdict": verdict})
    return {"verdict": verdict}


def steps() -> list[Step]:
    """Every step, most valuable first (the non-GPU ones are quick and give the rest their provenance)."""
    import gpucheck_nvml as nvml
    import gpucheck_train as train

    return [
        Step("environment", environment, (), 5, "the device, driver and package versions: the fixtures' provenance"),
        Step("install", install, (), 1, "the carried wheels install with --no-index on the device's Python"),
        Step("orchestrator_cli", orchestrator_cli, (), 10, "the orchestrator CLI runs from source with them"),
        *nvml.STEPS, *train.STEPS,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu/gpucheck.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where summary.json and logs.tar.gz go ($OUT)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check"), help="scratch (models, runs, logs)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole check's time (default %(default)s)")
    ap.add_argument("--only", action="append", help="run only these steps (repeatable)")
    a = ap.parse_args(argv)
    ctx = Ctx(out=a.out.resolve(), work=a.work.resolve(), budget_s=a.budget_s)
    chosen = [s for s in steps() if not a.only or s.name in a.only]
    summary = run_all(chosen, ctx)
    return 1 if summary["counts"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
