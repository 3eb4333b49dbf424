"""Turn a GPU check's output into test fixtures with their provenance.

    python bench/gpu/fixtures.py OUT_DIR [--dest tests/fixtures/gpu]

OUT_DIR holds what the device call returned (summary.json, logs.tar.gz). Each captured failure text becomes
`<class>__<device>__<what>.log` and each NVML reading set `nvml__<device>.jsonl` in DEST, and DEST/index.jsonl
gets one line per file: the class the step expected, the phase and exit code the supervisor would have known,
the device, driver, CUDA and package versions, and the date. tests/test_gpu_fixtures.py classifies every
text and replays every NVML reading on CPU. Exit 2 when OUT_DIR holds no check output.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEST = REPO / "tests" / "fixtures" / "gpu"
# log in logs.tar.gz -> (step, where its exit code is in the step's result, expected class, phase known)
CAPTURES = {
    "oom_startup_weights.txt": ("oom_at_startup", ("weights", "exit_code"), "cold_start_oom", "startup"),
    "oom_startup_swift.txt": ("oom_at_startup", ("swift", "exit_code"), "cold_start_oom", "startup"),
    "oom_training.txt": ("oom_after_steps", ("exit_code",), "oom_during_training", "training"),
    "fla_oom.txt": ("fla_backward_oom", ("exit_code",), "fla_backward_oom", None),
}
NVML = "nvml_vs_smi.jsonl"
VERSIONS = ("torch", "triton", "transformers", "peft", "ms-swift", "flash-linear-attention", "megatron-core",
            "nvidia-ml-py")


def slug(text: str) -> str:
    """A file-name part from a device name: 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return re.sub(r"^nvidia-", "", words) or "unknown"


def provenance(summary: dict) -> dict:
    """Where and with what the check ran, from its environment step."""
    env: dict = next((s["result"] for s in summary["steps"]
                      if s["name"] == "environment" and s["status"] == "ran"), {})
    device = env.get("device") or summary.get("device") or {}
    versions = env.get("versions", {})
    return {"device": (device.get("gpus") or ["unknown"])[0], "driver": device.get("driver"),
            "cuda": device.get("cuda_version"), "kernel": env.get("kernel"), "python": env.get("python"),
            "versions": {k: versions.get(k) for k in VERSIONS},
            "date": time.strftime("%Y-%m-%d", time.gmtime(summary.get("started_at", time.time())))}


def dig(data: object, path: tuple[str, ...]) -> object:
    """The value at `path` in nested dicts, or None where it is missing."""
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def export(out: Path, dest: Path = DEST) -> list[dict]:
    """Write the fixtures of one check's output into `dest`; returns the index lines written."""
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    origin = provenance(summary)
    device = slug(origin["device"])
    results = {s["name"]: s for s in summary["steps"]}
    dest.mkdir(parents=True, exist_ok=True)
    entries = []
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {Path(n).name: n for n in tar.getnames()}
        for log, (step, code_at, label, phase) in CAPTURES.items():
            if log not in names:
                continue
            member = tar.extractfile(names[log])
            if member is None:
                continue
            name = f"{label}__{device}__{log.removesuffix('.txt')}.log"
            (dest / name).write_bytes(member.read())
            entries.append({"file": name, "label": label, "step": step, "phase": phase,
                            "exit_code": dig(results.get(step, {}).get("result", {}), code_at), **origin})
        if NVML in names and (member := tar.extractfile(names[NVML])) is not None:
            name = f"nvml__{device}.jsonl"
            (dest / name).write_bytes(member.read())
            entries.append({"file": name, "label": None, "step": "nvml_vs_smi", **origin})
    index = dest / "index.jsonl"
    kept = [line for line in (index.read_text(encoding="utf-8").splitlines() if index.exists() else [])
            if line.strip() and json.loads(line)["file"] not in {e["file"] for e in entries}]
    index.write_text("".join(f"{line}\n" for line in kept + [json.dumps(e) for e in entries]), encoding="utf-8")
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu/fixtures.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the device call's returned files (summary.json, logs.tar.gz)")
    ap.add_argument("--dest", type=Path, default=DEST, help="default: %(default)s")
    a = ap.parse_args(argv)
    if not (a.out / "summary.json").is_file() or not (a.out / "logs.tar.gz").is_file():
        print(f"fixtures: error: {a.out}: no summary.json and logs.tar.gz (the GPU check's $OUT)", file=sys.stderr)
        return 2
    for e in export(a.out, a.dest):
        print(f"{a.dest / e['file']}: {e['label'] or 'NVML readings'} ({e['device']}, driver {e['driver']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
