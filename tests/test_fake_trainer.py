"""The fake trainer (tests/support/fake_trainer.py) behaves like `megatron sft` / `swift sft` from outside."""
from __future__ import annotations

import ast
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import crash_texts
from fake_runs import FAKE, MEG, SWIFT, env_for, run  # noqa: F401
from orchestrator.types import CrashClass


def progress(stdout: str) -> dict[int, dict]:
    """Step -> stdout dict (Python repr; megatron floats may be bare `nan`)."""
    recs = {}
    for line in stdout.splitlines():
        if line.startswith("{'loss'"):
            d = eval(line, {"__builtins__": {}}, {"nan": float("nan")})  # noqa: S307 - test data
            key = d.get("iteration") or d["global_step/max_steps"]
            recs[int(key.split("/")[0])] = d
    return recs


def read_safetensors(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    for k, v in header.items():
        a, b = v["data_offsets"]
        count = 1
        for dim in v["shape"]:
            count *= dim
        assert v["dtype"] == "F32" and b - a == 4 * count, k
        assert 8 + n + b <= len(raw)
    return header


# --- normal runs ---------------------------------------------------------------------------------------

def test_megatron_full_run_tree_and_output(tmp_path):
    out = tmp_path / "out"
    r = run(out, *MEG, "--lora_rank", "4", "--lora_alpha", "16", "--target_modules", "all-linear",
            "--merge_lora", "true", "--no_save_optim", "false")
    assert r.returncode == 0, r.stderr
    recs = progress(r.stdout)
    assert sorted(recs) == [1, 2, 4, 6, 8, 10, 12]
    for line in r.stdout.splitlines():
        ast.literal_eval(line)  # every stdout line is a dict repr
    first = recs[1]
    assert list(first) == ["loss", "grad_norm", "learning_rate", "load_balancing_loss", "iteration", "elapsed_time",
                           "remaining_time", "memory(GiB)", "train_speed(s/it)"]
    assert first["iteration"] == "1/12" and isinstance(first["loss"], float)

    for n in (5, 10, 12):
        ck = out / f"checkpoint-{n}"
        assert (ck / "latest_checkpointed_iteration.txt").read_text() == str(n)
        assert json.loads((ck / "args.json").read_text())["max_steps"] == 12
        it = ck / f"iter_{n:07d}"
        for name in ("common.pt", "__0_0.distcp", ".metadata", "metadata.json"):
            assert (it / name).is_file(), name
        tensors = read_safetensors(ck / "adapter_model.safetensors")
        assert "base_model.model.model.layers.0.self_attn.linear_qkv.lora_A.weight" in tensors
        assert tensors["base_model.model.model.layers.0.self_attn.linear_qkv.lora_A.weight"]["shape"] == [4, 64]
        assert tensors["base_model.model.model.layers.0.self_attn.linear_qkv.lora_B.weight"]["shape"] == [64, 4]
        cfg = json.loads((ck / "adapter_config.json").read_text())
        assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 16.0, "LORA")
        assert "linear_qkv" in cfg["target_modules"]
        # written in the real order: the iteration file and adapter before the completeness marker
        assert (ck / "latest_checkpointed_iteration.txt").stat().st_mtime_ns <= (ck / "adapter_config.json").stat().st_mtime_ns
        merged = out / f"checkpoint-{n}-merged"
        assert read_safetensors(merged / "model.safetensors")
        assert (merged / f"iter_{n:07d}" / "common.pt").is_file()
        assert f"Successfully saved `safetensors` model weights in `{ck}`." in r.stderr
        assert f"Successfully saved Megatron model weights in `{ck}`." in r.stderr
    assert os.readlink(out / "last-checkpoint") == "checkpoint-12"
    assert not (out / "last-checkpoint.tmp").exists()
    lines = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines[:-1]] == [f"{k}/12" for k in (1, 2, 4, 6, 8, 10, 12)]
    assert lines[0]["loss"] == first["loss"]
    assert lines[-1] == {"last_model_checkpoint": str(out / "checkpoint-12"), "best_model_checkpoint": None,
                         "best_metric": None}
    assert "[INFO:swift]" in r.stderr and "Train:  41%|" in r.stderr and "\r" in r.stderr


def test_megatron_no_merge_no_optim(tmp_path):
    out = tmp_path / "out"
    r = run(out, "--train_iters", "4", "--save_steps", "2", "--merge_lora", "false", "--no_save_optim", "true")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["args.json", "checkpoint-2", "checkpoint-4", "last-checkpoint",
                                                    "logging.jsonl"]
    assert [p.name for p in (out / "checkpoint-2" / "iter_0000002").iterdir()] == ["common.pt"]


def test_swift_full_run_tree_and_output(tmp_path):
    out = tmp_path / "out"
    r = run(out, *SWIFT, "--lora_rank", "8", FAKE_NPROC=1)
    assert r.returncode == 0, r.stderr
    recs = progress(r.stdout)
    assert sorted(recs) == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(v, str) for d in recs.values() for v in d.values())  # transformers 5: .4g strings
    assert recs[1]["global_step/max_steps"] == "1/6" and float(recs[1]["loss"]) > 0
    summary = ast.literal_eval(r.stdout.splitlines()[-1])
    assert summary["global_step/max_steps"] == "6/6" and "train_runtime" in summary
    for n in (2, 4, 6):
        ck = out / f"checkpoint-{n}"
        names = {p.name for p in ck.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "optimizer.pt",
                "scheduler.pt", "rng_state.pth", "args.json"} <= names
        st = json.loads((ck / "trainer_state.json").read_text())
        assert (st["global_step"], st["max_steps"]) == (n, 6) and st["log_history"][-1]["step"] == n
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in read_safetensors(
            ck / "adapter_model.safetensors")
        assert f"[INFO:swift] Saving model checkpoint to {ck}\n" in r.stderr
    assert os.readlink(out / "last-checkpoint") == "checkpoint-6"
    lines = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] == pytest.approx(float(recs[1]["loss"]), rel=1e-3)
    assert lines[-2]["global_step/max_steps"] == "6/6" and lines[-1]["last_model_checkpoint"] == str(out / "checkpoint-6")


@pytest.mark.parametrize("flags", [("--mcore_adapter",), ("--adapters",)])
def test_megatron_resume_continues_with_identical_loss(tmp_path, flags):
    base = run(tmp_path / "a", "--train_iters", "12", "--save_steps", "5", "--logging_steps", "1")
    out = tmp_path / "b"
    first = run(out, "--train_iters", "12", "--save_steps", "5", "--logging_steps", "1", FAKE_EXIT_AFTER_STEP=7)
    assert first.returncode == 0 and max(progress(first.stdout)) == 7  # stopped early, exit 0
    assert json.loads((out / "logging.jsonl").read_text().splitlines()[-1])["last_model_checkpoint"].endswith("checkpoint-5")
    second = run(out, "--train_iters", "12", "--save_steps", "5", "--logging_steps", "1",
                 flags[0], str(out / "checkpoint-5"), "--finetune", "false")
    assert second.returncode == 0, second.stderr
    resumed, full = progress(second.stdout), progress(base.stdout)
    assert min(resumed) == 6 and max(resumed) == 12
    for k in resumed:
        assert (resumed[k]["loss"], resumed[k]["grad_norm"], resumed[k]["learning_rate"]) == (
            full[k]["loss"], full[k]["grad_norm"], full[k]["learning_rate"])
    assert os.readlink(out / "last-checkpoint") == "checkpoint-12"


def test_megatron_adapters_without_finetune_false_restarts_at_one(tmp_path):
    out = tmp_path / "out"
    assert run(out, "--train_iters", "4", "--save_steps", "2", "--logging_steps", "1").returncode == 0
    r = run(out, "--train_iters", "4", "--logging_steps", "1", "--adapters", str(out / "checkpoint-2"))
    assert min(progress(r.stdout)) == 1


def test_swift_resume_continues_with_identical_loss(tmp_path):
    base = run(tmp_path / "a", *SWIFT, FAKE_NPROC=1)
    out = tmp_path / "b"
    assert run(out, *SWIFT, FAKE_NPROC=1, FAKE_EXIT_AFTER_STEP=3).returncode == 0
    r = run(out, *SWIFT, "--resume_from_checkpoint", str(out / "checkpoint-2"), FAKE_NPROC=1)
    assert r.returncode == 0, r.stderr
    resumed, full = progress(r.stdout), progress(base.stdout)
    assert min(resumed) == 3
    assert all(resumed[k]["loss"] == full[k]["loss"] for k in resumed)
    hist = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6]


def test_resume_from_missing_checkpoint_fails(tmp_path):
    r = run(tmp_path / "o", *SWIFT, "--resume_from_checkpoint", str(tmp_path / "nope"))
    assert r.returncode == 1 and "Can't find a valid checkpoint" in r.stderr


# --- faults --------------------------------------------------------------------------------------------

SIGNATURES = {
    CrashClass.COLD_START_OOM: ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "load_weights"],
    CrashClass.FLA_BACKWARD_OOM: ["fla/ops/gated_delta_rule/chunk.py", "chunk_gated_delta_rule_bwd",
                                  "fla/ops/common/chunk_o.py", "Tried to allocate 266.00 MiB"],
    CrashClass.OOM_DURING_TRAINING: ["CUDA out of memory", "megatron/core/tensor_parallel/cross_entropy.py"],
    CrashClass.NCCL_ERROR: ["torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
                            "ProcessGroupNCCL.cpp:", "unhandled cuda error", "ncclUnhandledCudaError"],
    CrashClass.PORT_IN_USE: ["torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                             "network address. port: 29611, useIpv6: false, code: -98, name: EADDRINUSE"],
    CrashClass.CUDA_FATAL: ["torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                            "CUDA kernel errors might be asynchronously reported"],
    CrashClass.OTHER: ["ValueError: remaining_argv: ['--bogus', '1']"],
}
STEP_OF = {CrashClass.COLD_START_OOM: 0, CrashClass.PORT_IN_USE: 0, CrashClass.OTHER: 0}


@pytest.mark.parametrize("cls", list(SIGNATURES) + [CrashClass.HOST_OOM_KILLED])
def test_fault_text_and_exit_status(tmp_path, cls):
    step = STEP_OF.get(cls, 3)
    r = run(tmp_path / "o", *MEG, "--logging_steps", "1", FAKE_FAULTS=f"{cls}@{step}")
    status = crash_texts.exit_status(cls)
    assert r.returncode == (-status if isinstance(status, signal.Signals) else status), r.stderr[-2000:]
    steps = progress(r.stdout)
    assert (max(steps) if steps else 0) == max(step - 1, 0)
    for sig in SIGNATURES.get(cls, []):
        assert sig in r.stderr, sig
    if cls is CrashClass.HOST_OOM_KILLED:
        assert "Traceback" not in r.stderr  # SIGKILL: nothing from the worker
    elif cls is not CrashClass.PORT_IN_USE:
        assert "[rank3]: " in r.stderr and "Root Cause (first observed failure):" in r.stderr
        assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:" in r.stderr
        # the other ranks: SIGTERMed by torchrun, or failed themselves (listed under Failures)
        assert "closing signal SIGTERM" in r.stderr or "Failures:\n[1]:" in r.stderr


def test_oom_during_training_is_not_in_fla(tmp_path):
    r = run(tmp_path / "o", *MEG, FAKE_FAULTS="oom_during_training@2")
    assert "fla/" not in r.stderr and "CUDA out of memory" in r.stderr


def test_swift_backend_texts(tmp_path):
    r = run(tmp_path / "o", *SWIFT, FAKE_NPROC=1, FAKE_FAULTS="fla_backward_oom@2")
    assert r.returncode == 1
    assert "transformers/trainer.py" in r.stderr and "chunk_bwd_dv_local" in r.stderr
    assert "[rank" not in r.stderr and "ChildFailedError" not in r.stderr  # one process, no torchrun


def test_torchrun_launcher_exit(tmp_path):
    r = run(tmp_path / "o", *MEG, FAKE_FAULTS="host_oom_killed@2", FAKE_LAUNCHER="torchrun")
    assert r.returncode == 1
    assert "exitcode  : -9 (pid:" in r.stderr and "Signal 9 (SIGKILL) received by PID" in r.stderr


def test_faults_fire_once_with_state(tmp_path):
    out, state = tmp_path / "o", tmp_path / "state.json"
    faults = "port_in_use@0,nccl_error@4"
    r1 = run(out, *MEG, FAKE_FAULTS=faults, FAKE_STATE=state)
    assert r1.returncode == 1 and "EADDRINUSE" in r1.stderr and not progress(r1.stdout)
    r2 = run(out, *MEG, "--logging_steps", "1", FAKE_FAULTS=faults, FAKE_STATE=state)
    assert r2.returncode == 1 and "ncclUnhandledCudaError" in r2.stderr and max(progress(r2.stdout)) == 3
    r3 = run(out, *MEG, FAKE_FAULTS=faults, FAKE_STATE=state)
    assert r3.returncode == 0, r3.stderr
    assert json.loads(state.read_text())["fired"] == ["port_in_use@0", "nccl_error@4"]
    # without FAKE_STATE a fault fires every time
    assert run(out, *MEG, FAKE_FAULTS="nccl_error@4").returncode == 1
    assert run(out, *MEG, FAKE_FAULTS="nccl_error@4").returncode == 1


def test_fault_at_or_before_resume_step_never_fires(tmp_path):
    out = tmp_path / "o"
    assert run(out, *MEG, FAKE_EXIT_AFTER_STEP=5).returncode == 0
    r = run(out, *MEG, "--mcore_adapter", str(out / "checkpoint-5"), "--finetune", "false",
            FAKE_FAULTS="fla_backward_oom@5,nccl_error@2")
    assert r.returncode == 0, r.stderr
    r = run(out, *MEG, "--mcore_adapter", str(out / "checkpoint-5"), "--finetune", "false",
            FAKE_FAULTS="fla_backward_oom@6")
    assert r.returncode == 1 and "chunk_bwd_dv_local" in r.stderr


@pytest.mark.parametrize("backend", ["megatron", "swift"])
def test_disk_full_leaves_incomplete_checkpoint(tmp_path, backend):
    out = tmp_path / "o"
    flags = ("--train_iters", "8") if backend == "megatron" else ("--max_steps", "8")
    r = run(out, *flags, "--save_steps", "2", "--logging_steps", "1", FAKE_FAULTS="disk_full@3")
    assert r.returncode == 1
    assert "No space left on device" in r.stderr or "PytorchStreamWriter failed writing file" in r.stderr
    assert max(progress(r.stdout)) == 4
    bad = out / "checkpoint-4"
    assert bad.is_dir()
    assert not (bad / "latest_checkpointed_iteration.txt").exists() and not (bad / "trainer_state.json").exists()
    if backend == "megatron":
        assert not (bad / "adapter_config.json").exists() and (bad / "iter_0000004").is_dir()
    assert os.readlink(out / "last-checkpoint") == "checkpoint-2"


@pytest.mark.parametrize("backend", ["megatron", "swift"])
def test_nan_loss_keeps_going(tmp_path, backend):
    flags = MEG if backend == "megatron" else SWIFT
    r = run(tmp_path / "o", *flags, "--logging_steps", "1", FAKE_FAULTS="nan_loss@3")
    assert r.returncode == 0
    recs = progress(r.stdout)
    assert max(recs) == (12 if backend == "megatron" else 6)
    if backend == "megatron":
        assert "'loss': nan, 'grad_norm': nan" in r.stdout
        assert recs[2]["loss"] == recs[2]["loss"] and all(recs[k]["loss"] != recs[k]["loss"] for k in recs if k >= 3)
    else:
        assert recs[2]["loss"] != "nan" and all(recs[k]["loss"] == "nan" == recs[k]["grad_norm"] for k in recs if k >= 3)


def test_silent_hang_stays_alive_until_killed(tmp_path):
    log = tmp_path / "stdout.txt"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, FAKE, "sft", "--output_dir", str(tmp_path / "o"), *MEG,
                              "--logging_steps", "1"], env=env_for(FAKE_FAULTS="nccl_timeout_hang@4"),
                             stdout=f, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while "'iteration': '3/12'" not in log.read_text():
            assert p.poll() is None, "exited instead of hanging"
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.5)  # alive and silent
        assert "'4/12'" not in log.read_text()
        p.terminate()
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()


def test_watchdog_hang_aborts(tmp_path):
    r = run(tmp_path / "o", *MEG, FAKE_FAULTS="nccl_timeout_hang@4", FAKE_HANG_MODE="watchdog")
    assert r.returncode == -signal.SIGABRT
    assert "[rank3]:[E" in r.stderr and "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=" in r.stderr
    assert "OpType=_REDUCE_SCATTER_BASE" in r.stderr and "Timeout(ms)=600000) ran for 6000" in r.stderr
    assert "terminate called after throwing an instance of 'c10::DistBackendError'" in r.stderr


def test_sigterm_kills_at_once(tmp_path):
    log = tmp_path / "stdout.txt"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, FAKE, "sft", "--output_dir", str(tmp_path / "o"), "--train_iters", "100000",
                              "--logging_steps", "1"], env=env_for(FAKE_STEP_S="0.01"), stdout=f, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while "'iteration': '2/" not in log.read_text():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()


def test_rejected_flag_fails_like_ms_swift(tmp_path):
    r = run(tmp_path / "o", *MEG, "--use_megatron", "true", "--unknown_but_ignored", "x",
            FAKE_REJECT_FLAGS="use_megatron", FAKE_NPROC=1)
    assert r.returncode == 1
    assert r.stderr.rstrip().endswith("ValueError: remaining_argv: ['--use_megatron', 'true']")
    assert run(tmp_path / "p", *MEG, "--unknown_but_ignored", "x").returncode == 0


def test_fast_start(tmp_path):
    t = time.monotonic()
    r = run(tmp_path / "o", "--train_iters", "1", "--save_steps", "100", "--merge_lora", "false")
    assert r.returncode == 0
    assert time.monotonic() - t < 2.0  # generous: start-up itself is ~0.1 s


# --- crash_texts directly ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", list(CrashClass))
@pytest.mark.parametrize("backend", ["megatron", "swift"])
def test_crash_texts_all_classes(cls, backend):
    t = crash_texts.text(cls, step=7, nranks=8, port=29555, backend=backend, pid=4321)
    assert t.endswith("\n")
    if cls not in (CrashClass.NAN_LOSS, CrashClass.PORT_IN_USE):
        assert "Root Cause (first observed failure):" in t and "rank      : 3 (local_rank: 3)" in t
        assert "(pid: 4321)" in t
    single = crash_texts.text(cls, step=7, nranks=1, port=29555, backend=backend)
    if cls is not CrashClass.PORT_IN_USE:
        assert "[rank" not in single and "ChildFailedError" not in single
    status = crash_texts.exit_status(cls)
    assert status in (0, 1, signal.SIGABRT, signal.SIGKILL)
