"""The prepared GPU check (bench/gpu/) on a machine without a GPU: the whole check runs, records every step
("ran" / "skipped: why" / "failed: output") in summary.json and packs its logs; the CUDA steps say why they
skipped. The parts that need no GPU run for real: the runner, the NVML/nvidia-smi comparison, the supervisor
flows of the stale-holder steps against the orchestrator's GPU stand-in (a fake holder that holds no memory),
the recipes the GPU steps write, and the classification of the OOM probe's log format. A few seconds."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import gpucheck
import gpucheck_nvml as nvml
import gpucheck_procs as procs
from gpucheck_base import Ctx, Failed, Skip, Step, last_json
from gpucheck_recipe import GPU_SETS, gpu_recipe

from orchestrator.config.recipe import load
from orchestrator.domain.classify import classify
from orchestrator.types import CrashClass

CUDA_STEPS = ["nvml_vs_smi", "stale_holder_refused", "kill_pattern_holder", "oom_at_startup", "oom_after_steps",
              "swift_sft_resume", "fla_backward_oom", "megatron_sft"]
no_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with nvidia-smi runs the CUDA steps")


# ------------------------------------------------------------------------------------------ the whole check

@no_gpu
def test_the_whole_check_on_cpu_runs_what_needs_no_gpu_and_says_why_the_rest_skipped(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "check.sh")], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = {r["name"]: r for r in summary["steps"]}
    assert list(rows) == ["environment", "install", "orchestrator_cli", *CUDA_STEPS]
    for r in summary["steps"]:
        assert {"name", "status", "seconds", "proves", "result"} <= set(r), r
        assert r["status"] == "ran" or r["status"].startswith(("skipped: ", "failed: ")), r
    assert rows["environment"]["status"] == "ran"
    assert rows["environment"]["result"]["device"] == {"cuda": False}
    assert rows["environment"]["result"]["versions"]["pydantic"]
    assert rows["install"]["status"].startswith("skipped: no carried wheels")
    assert rows["orchestrator_cli"]["status"] == "ran"
    assert rows["orchestrator_cli"]["result"]["verdict"]["class"] == "cold_start_oom"
    for name in CUDA_STEPS:
        assert rows[name]["status"] == "skipped: no CUDA device (nvidia-smi not found)", rows[name]
    assert summary["counts"] == {"ran": 2, "skipped": 9, "failed": 0}
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert "logs/orchestrator_cli.log" in tar.getnames()
    assert "ran 2, skipped 9, failed 0" in done.stdout     # the table the device tool's output tail shows


def test_a_failed_install_is_a_failed_step_with_pips_output(tmp_path):
    ctx = Ctx(out=tmp_path / "out", work=tmp_path, budget_s=60)
    ctx.logs.mkdir()
    (tmp_path / "install.rc").write_text("1\n")
    ctx.log("install.log").write_text("ERROR: x-1-cp312-cp312-manylinux_2_17_x86_64.whl is not a supported wheel\n")
    row = gpucheck.run_step(Step("install", gpucheck.install, (), 1, "-"), ctx)
    assert row["status"].startswith("failed: pip install of the carried wheels exited 1:\nERROR: x-1-cp312")


# ------------------------------------------------------------------------------------------ the runner

def _ctx(tmp_path, budget_s=60.0, **missing) -> Ctx:
    ctx = Ctx(out=tmp_path / "out", work=tmp_path / "work", budget_s=budget_s)
    ctx.cache.update(missing)
    return ctx


@pytest.mark.parametrize("run, need, budget, want", [
    (lambda ctx: {"x": 1}, None, 60, "ran"),
    (lambda ctx: {"x": 1}, "no CUDA device (nvidia-smi not found)", 60, "skipped: no CUDA device (nvidia-smi not found)"),
    (lambda ctx: {"x": 1}, None, 5, "skipped: time budget: 5 s left of 5 s, the step takes ~10 s"),
    (lambda ctx: (_ for _ in ()).throw(Skip("fla has no kernel for this GPU")), None, 60,
     "skipped: fla has no kernel for this GPU"),
    (lambda ctx: (_ for _ in ()).throw(Failed("NVML 512 MiB vs nvidia-smi 0 MiB", {"a": 1})), None, 60,
     "failed: NVML 512 MiB vs nvidia-smi 0 MiB"),
])
def test_a_step_ends_as_ran_skipped_with_why_or_failed_with_output(tmp_path, run, need, budget, want):
    row = gpucheck.run_step(Step("s", run, ("cuda",), 10, "-"), _ctx(tmp_path, budget, cuda=need))
    assert row["status"] == want
    assert row["result"] == ({"x": 1} if want == "ran" else {"a": 1} if want.startswith("failed") else {})


def test_a_long_failure_keeps_its_first_line_and_its_tail():
    status = gpucheck.status_of("failed", "no launch after the holder was killed:\n" + "x" * 5000 + "\nthe end")
    assert status.startswith("failed: no launch after the holder was killed:\n[...]\n")
    assert status.endswith("x\nthe end") and len(status) <= gpucheck.OUTPUT_TAIL + 20


def test_a_step_that_raises_fails_with_its_traceback_and_the_check_goes_on(tmp_path):
    def broken(ctx):
        raise KeyError("gpus")

    ctx = _ctx(tmp_path)
    summary = gpucheck.run_all([Step("broken", broken, (), 0, "-"), Step("after", lambda c: {}, (), 0, "-")], ctx,
                               say=lambda line: None)
    first, second = summary["steps"]
    assert first["status"].startswith("failed: Traceback") and "KeyError: 'gpus'" in first["status"]
    assert second["status"] == "ran"
    assert summary["counts"] == {"ran": 1, "skipped": 0, "failed": 1}
    assert json.loads((ctx.out / "summary.json").read_text())["counts"] == summary["counts"]


def test_a_long_log_keeps_its_tail_in_the_tarball(tmp_path, monkeypatch):
    monkeypatch.setattr(gpucheck, "LOG_CAP_BYTES", 100)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "big.log").write_bytes(b"x" * 1000 + b"the end\n")
    gpucheck.pack_logs(logs, tmp_path / "l.tar.gz")
    with tarfile.open(tmp_path / "l.tar.gz") as tar:
        text = tar.extractfile("logs/big.log").read()
    assert text.startswith(b"[... cut") and text.endswith(b"the end\n") and len(text) < 200


# ------------------------------------------------------------------------------------------ NVML vs nvidia-smi

def _nvml(used=512, pids=((4242, 8000),), name="NVIDIA H100 80GB HBM3", error=None):
    return {"error": error, "gpus": [{"index": 0, "name": name, "uuid": "GPU-1", "total_mib": 81559, "used_mib": used,
                                      "processes": [{"pid": p, "used_mib": m} for p, m in pids]}]}


SMI = [{"index": "0", "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "memory.total": "81559", "memory.used": "512",
        "driver_version": "580.159.04"}]
APPS = [{"pid": "4242", "gpu_uuid": "GPU-1", "used_memory": "8000"}]


@pytest.mark.parametrize("reading, apps, want", [
    (_nvml(), APPS, []),
    (_nvml(used=560, pids=((4242, 8040),)), APPS, []),                   # read a moment apart: within 64 MiB
    (_nvml(used=1536), APPS, ["GPU 0: used_mib 1536 vs nvidia-smi 512 MiB"]),
    (_nvml(pids=()), APPS, ["GPU 0: NVML processes [] vs nvidia-smi [4242]"]),
    (_nvml(pids=((4242, 9000),)), APPS, ["GPU 0 pid 4242: 9000 vs nvidia-smi 8000 MiB"]),
    (_nvml(name="NVIDIA H200"), APPS, ["GPU 0: name 'NVIDIA H200' vs nvidia-smi 'NVIDIA H100 80GB HBM3'"]),
    (_nvml(error="NVML unavailable: Driver Not Loaded"), APPS, ["NVML unreadable: NVML unavailable: Driver Not Loaded"]),
])
def test_differences_between_the_nvml_reader_and_nvidia_smi(reading, apps, want):
    assert nvml.differences(reading, SMI, apps) == want


@pytest.mark.parametrize("text, want", [
    ('$ orchestrator classify x --json\n{"class": "other"}\n\n[exit 0]\n', {"class": "other"}),
    ('$ orchestrator history r.toml --json\n{\n  "run": "r",\n  "attempts": [\n    {"n": 1}\n  ]\n}\n[exit 0]\n',
     {"run": "r", "attempts": [{"n": 1}]}),
    ('warning: {not json}\n{"a": 1}\nnoise\n{"b": 2}\n', {"b": 2}),
])
def test_a_commands_json_answer_is_found_among_its_output(text, want):
    assert last_json(text) == want


def test_no_json_answer_is_a_failure_with_the_output():
    with pytest.raises(Failed, match="no JSON line in the output:\n\\$ orchestrator history"):
        last_json("$ orchestrator history r.toml --json\norchestrator: error: no journal yet\n")


def test_nvidia_smi_csv_rows():
    rows = procs.parse_csv("0, GPU-1, NVIDIA H200, 143771, 0, 580.159.03\n", procs.GPU_KEYS)
    assert rows == [{"index": "0", "uuid": "GPU-1", "name": "NVIDIA H200", "memory.total": "143771",
                     "memory.used": "0", "driver_version": "580.159.03"}]


# ------------------------------------------------------------------------------------------ holders, supervised

FAKE_HOLDER = """
import json, os, sys, time
json.dump({"default": {"gpus": 1, "used_mib": 8192, "pids": [os.getpid()]}}, open(sys.argv[1], "w"))
print(json.dumps({"pid": os.getpid(), "held_mib": 8192, "free_mib": 0, "tag": sys.argv[-1]}), flush=True)
while True:
    time.sleep(1)
"""
IDLE = {"default": {"gpus": 1, "used_mib": 0, "pids": []}}


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """One stand-in GPU (the orchestrator's ORCHESTRATOR_GPU_STANDIN seam); the holders hold it in that file
    and, like the driver, the file frees it once the holder is dead. The trainer is a sleeper."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}   # a session's servers stay
    path = tmp_path / "standin.json"
    path.write_text(json.dumps(IDLE))
    monkeypatch.setenv("ORCHESTRATOR_GPU_STANDIN", str(path))
    monkeypatch.setattr(nvml, "holder_argv", lambda ctx, tag, size: [ctx.python, "-c", FAKE_HOLDER, str(path), tag])
    started = nvml.start_holder

    def start_holder(*a, **k):
        p, held = started(*a, **k)

        def freed() -> None:
            p.p.wait()   # reaped: the driver would free its memory now
            path.write_text(json.dumps(IDLE))
        threading.Thread(target=freed, daemon=True).start()
        return p, held
    monkeypatch.setattr(nvml, "start_holder", start_holder)

    def sleeper_recipe(*a, **k):
        return gpu_recipe(*a, **k, run={"entrypoint": [sys.executable, "-c", "import time; time.sleep(120)"]})
    monkeypatch.setattr(nvml, "gpu_recipe", sleeper_recipe)
    tiny = tmp_path / "tiny"
    (tiny / "tiny-moe").mkdir(parents=True)
    (tiny / "tiny-moe" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
        "vocab_size": 1500, "num_experts": 4, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}))
    (tiny / "tiny-moe" / "model.safetensors").write_bytes(b"")
    (tiny / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    ctx = Ctx(out=tmp_path / "out", work=tmp_path / "work", budget_s=120)
    ctx.logs.mkdir(parents=True)
    ctx.cache["tiny"] = tiny
    yield ctx
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    pids = [p.pid for p in left]
    for p in left:   # the steps stop what they start: anything left is a bug, killed here and reported
        p.kill()
    assert not pids, f"the step left processes running: {pids}"


def test_a_foreign_holder_keeps_orchestrator_run_from_launching_and_the_refusal_names_it(standin):
    result = nvml.stale_holder_refused(standin)
    pid = result["holder"]["pid"]
    assert f"gpus_not_clear: GPU 0: held by pid {pid}; GPU 0: 8192 MiB used (threshold 1024 MiB)" in result["refusal"]
    assert result["refused_again"] and result["holder_alive"] and not result["launched"]
    assert result["supervisor_exit"] == 0      # SIGTERM: a graceful stop
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_holder_matching_kill_patterns_is_killed_then_the_gpu_is_clear_and_the_trainer_launches(standin):
    result = nvml.kill_pattern_holder(standin)
    assert result["holder_returncode"] == -9                       # the supervisor's SIGKILL
    assert f"held by pid {result['holder']['pid']}" in result["refusal"]
    assert result["launch"] and " launch: attempt 1 pid " in result["launch"]
    assert 0 <= result["exit_to_clear_s"] < 5 and 0 <= result["exit_to_launch_s"] < 30
    assert result["supervisor_exit"] == 0


def test_a_holder_that_never_starts_fails_the_step_with_its_output(standin, monkeypatch):
    monkeypatch.setattr(nvml, "holder_argv", lambda ctx, tag, size: [ctx.python, "-c", "print('no CUDA here')"])
    with pytest.raises(Failed, match="the GPU holder did not start:\n.*no CUDA here"):
        nvml.stale_holder_refused(standin)


# ------------------------------------------------------------------------------------------ recipes, OOM text

def test_the_gpu_recipes_are_valid_recipes(tmp_path):
    r = load(gpu_recipe(tmp_path / "a", tmp_path / "tiny", "gpucheck-a", kill_patterns=("stale-trainer",)))
    assert (r.gpu.check, r.gpu.kill_patterns, r.env.vars["CUDA_VISIBLE_DEVICES"]) == (True, ["stale-trainer"], "0")
    assert (r.model.torch_dtype, r.extra_args["bf16"], r.extra_args["use_cpu"]) == ("bfloat16", True, False)
    m = load(gpu_recipe(tmp_path / "m", tmp_path / "tiny", "gpucheck-m", run={"backend": "megatron"},
                        checkpoint={"merge": "never"}, replace={"extra_args": {}}))
    assert m.run.backend == "megatron" and m.extra_args == {}
    demo = load(ROOT / "orchestrator" / "data" / "demo-cpu.toml", GPU_SETS)   # what swift_sft_resume gives `demo --set`
    assert demo.gpu.check and demo.env.vars["CUDA_VISIBLE_DEVICES"] == "0" and demo.extra_args["bf16"] is True


def test_the_training_probes_lines_make_its_oom_a_training_oom():
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import oom_probe

    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of "
           "139.81 GiB of which 3.12 GiB is free.")
    lines = "\n".join(oom_probe.swift_line(s, 17, 7.1, time.time()) for s in (1, 2, 3))
    assert classify(f"{lines}\nTraceback (most recent call last):\n{oom}").cls is CrashClass.OOM_DURING_TRAINING
    assert classify(f"Traceback (most recent call last):\n{oom}").cls is CrashClass.COLD_START_OOM


def test_stop_ends_a_process_and_everything_under_it(tmp_path):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('up', flush=True); time.sleep(60)")
    p = procs.Proc([sys.executable, "-c", code], tmp_path / "p.log")
    assert p.wait_line("^up$", 30)
    child = psutil.Process(p.pid).children()[0]
    assert p.stop(grace_s=2) == -15
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert "up" in (tmp_path / "p.log").read_text()
