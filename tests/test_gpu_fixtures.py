"""What the GPU check captured on a lent device, replayed on CPU: every failure text in tests/fixtures/gpu/
classifies as the class its step expected (with the phase and exit code the supervisor would have known, and
from the text alone), and every recorded NVML reading gives the same differences against nvidia-smi and the
same clear verdict. bench/gpu/fixtures.py writes them (docs/gpu-check.md); none has been captured yet, so
the replay is also tested here on a synthetic check output."""
from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import fixtures
import gpucheck_nvml as nvml

from orchestrator.domain.classify import classify
from orchestrator.host import gpu
from orchestrator.types import ExitStatus, Phase

GPU_FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
INDEX = GPU_FIXTURES / "index.jsonl"
ENTRIES = [json.loads(line) for line in INDEX.read_text().splitlines() if line.strip()] if INDEX.exists() else []


def check_capture(folder: Path, entry: dict) -> None:
    text = (folder / entry["file"]).read_text(errors="replace")
    exit_status = ExitStatus.from_returncode(entry["exit_code"]) if entry["exit_code"] is not None else None
    told = classify(text, exit_status, Phase(entry["phase"]) if entry["phase"] else None)
    assert told.cls.value == entry["label"], (entry["file"], told.evidence)
    assert classify(text).cls.value == entry["label"], (entry["file"], "from the text alone")


def check_nvml(folder: Path, entry: dict) -> None:
    for line in (folder / entry["file"]).read_text().splitlines():
        r = json.loads(line)
        assert nvml.differences(r["nvml"], r["nvidia_smi"], r["nvidia_smi_apps"]) == r["differences"], r["label"]
        assert list(gpu.clear_verdict(nvml.snapshot_of(r["nvml"]), nvml.GPU0, nvml.THRESHOLD_MIB)) == \
            [r["clear"], r["problems"]], r["label"]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["label"]], ids=lambda e: e["file"])
def test_a_captured_failure_classifies_as_its_step_expected(entry):
    check_capture(GPU_FIXTURES, entry)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e["label"]], ids=lambda e: e["file"])
def test_a_recorded_nvml_reading_replays_to_the_same_verdict(entry):
    check_nvml(GPU_FIXTURES, entry)


# ------------------------------------------------------------------------------------------ the export itself

OOM = ("{'loss': '7.31', 'global_step/max_steps': '3/17'}\nTraceback (most recent call last):\n"
       "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of "
       "79.19 GiB of which 3.12 GiB is free.\n")
MIB = 1024**2


def _reading(label: str, used_bytes: int, pids: tuple[int, ...]) -> dict:
    snap = gpu.GpuSnapshot(gpus=(gpu.GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559 * MIB, used_bytes,
                                             tuple(gpu.GpuProcess(p, 8200 * MIB) for p in pids), "GPU-1"),))
    data = nvml.snapshot_dict(snap)
    smi = [{"index": "0", "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "memory.total": "81559",
            "memory.used": str(used_bytes // MIB), "driver_version": "580.159.04"}]
    apps = [{"pid": str(p), "gpu_uuid": "GPU-1", "used_memory": "8200"} for p in pids]
    clear, problems = gpu.clear_verdict(snap, nvml.GPU0, nvml.THRESHOLD_MIB)
    return {"label": label, "nvml": data, "nvidia_smi": smi, "nvidia_smi_apps": apps, "clear": clear,
            "problems": problems, "differences": nvml.differences(data, smi, apps)}


def _check_output(out: Path) -> None:
    out.mkdir()
    summary = {"started_at": 1795680000.0, "steps": [
        {"name": "environment", "status": "ran", "result": {
            "device": {"cuda": True, "gpus": ["NVIDIA H100 80GB HBM3"], "driver": "580.159.04", "cuda_version": "13.0"},
            "kernel": "6.18.44-fc", "python": "3.12.3", "versions": {"torch": "2.11.0+cu130", "ms-swift": "4.6.0"}}},
        {"name": "oom_after_steps", "status": "ran", "result": {"exit_code": 1}}]}
    (out / "summary.json").write_text(json.dumps(summary))
    readings = "".join(json.dumps(_reading(label, used, pids)) + "\n"
                       for label, used, pids in (("idle", 0, ()), ("held", 8709 * MIB + 123, (4242,))))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for name, text in (("logs/oom_training.txt", OOM), ("logs/nvml_vs_smi.jsonl", readings)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_the_export_writes_each_capture_with_its_provenance_and_the_replay_passes(tmp_path):
    _check_output(tmp_path / "out")
    dest = tmp_path / "gpu"
    assert fixtures.main([str(tmp_path / "out"), "--dest", str(dest)]) == 0
    entries = [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]
    assert [e["file"] for e in entries] == ["oom_during_training__h100-80gb-hbm3__oom_training.log",
                                            "nvml__h100-80gb-hbm3.jsonl"]
    first = entries[0]
    assert (first["label"], first["phase"], first["exit_code"]) == ("oom_during_training", "training", 1)
    assert (first["device"], first["driver"], first["cuda"], first["date"]) == (
        "NVIDIA H100 80GB HBM3", "580.159.04", "13.0", "2026-11-26")
    assert first["versions"]["torch"] == "2.11.0+cu130" and first["versions"]["ms-swift"] == "4.6.0"
    check_capture(dest, first)
    check_nvml(dest, entries[1])
    assert fixtures.main([str(tmp_path / "out"), "--dest", str(dest)]) == 0        # again: replaced, not doubled
    assert len((dest / "index.jsonl").read_text().splitlines()) == 2


def test_the_export_refuses_a_folder_without_check_output(tmp_path, capsys):
    assert fixtures.main([str(tmp_path)]) == 2
    assert "no summary.json and logs.tar.gz" in capsys.readouterr().err


@pytest.mark.parametrize("name, want", [("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"), ("NVIDIA H200", "h200"),
                                        ("", "unknown")])
def test_device_names_become_file_name_parts(name, want):
    assert fixtures.slug(name) == want
