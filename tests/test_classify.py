"""Table-driven tests for orchestrator.domain.classify: own fixtures, conflicts, prefixes, phase (real logs: test_classify_real)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from real_crashes import ALL_REAL

from orchestrator.domain.classify import (
    _COMPILED,
    _CONDITIONS,
    RULES,
    WINDOW,
    classify,
    says_why,
    strip_prefixes,
)
from orchestrator.types import CrashClass, ExitStatus, Phase

FIXTURES = Path(__file__).parent / "fixtures" / "crashes"
FIXTURE_FILES = sorted(FIXTURES.glob("*.log"))


def _cleaned(text: str) -> str:
    return "\n".join(strip_prefixes(line) for line in text.splitlines())


# ---------------------------------------------------------------- own fixtures
def test_fixture_coverage() -> None:
    labels = [f.name.split("__")[0] for f in FIXTURE_FILES]
    for cls in CrashClass:
        assert labels.count(cls.value) >= 3, cls


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[f.name for f in FIXTURE_FILES])
def test_fixtures(path: Path) -> None:
    text = path.read_text()
    crash = classify(text)
    assert crash.cls.value == path.name.split("__")[0], crash.evidence
    assert 1 <= len(crash.evidence) <= 5
    cleaned = _cleaned(text)
    for line in crash.evidence:                 # evidence is real (cleaned) log text, prefixes gone
        assert line in cleaned or line in text or line.startswith("failing rank: "), line
        assert not re.match(r"\[rank\d+\]:|\[\d+,\d+\]<std", line)


# ---------------------------------------------------------------- conflicts and negatives (one log each)
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.11 GiB"
WATCHDOG = ("[rank0]:[E1120 22:13:01.1 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600061 milliseconds before timing out.")
PROGRESS = "{'loss': '7.43', 'grad_norm': '1.873', 'learning_rate': '9.973e-05', 'global_step/max_steps': '%d/30'}"
REMOTE = ("[rank5]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.")
MEGATRON = (" iteration %5d/  10000 | consumed samples: 100 | learning rate: 1.0E-05 | global batch size: 64 | %s"
            "loss scale: %s | grad norm: 0.7 | number of skipped iterations: %d | number of nan iterations: %d |")

CASES = [
    # OOM outranks the cascade it causes, wherever the OOM line sits.
    ("oom_then_watchdog", [PROGRESS % 3, f"[rank3]: {OOM}", WATCHDOG, "[rank6]: RuntimeError: NCCL communicator was aborted on rank 6."],
     CrashClass.OOM_DURING_TRAINING),
    ("watchdog_before_oom_line", [PROGRESS % 3, WATCHDOG, f"[rank3]: {OOM}"], CrashClass.OOM_DURING_TRAINING),
    ("nccl_cuda_failure_oom", ["node:1:2 [0] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'",
                               "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error"],
     CrashClass.COLD_START_OOM),
    ("nccl_wraps_illegal_access", ["torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled cuda error, NCCL version 2.21.5",
                                   "ncclUnhandledCudaError: Call to CUDA function failed.", "Last error:",
                                   "Cuda failure 'an illegal memory access was encountered'"], CrashClass.CUDA_FATAL),
    ("remote_error_beats_timeout", [WATCHDOG, "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."],
     CrashClass.NCCL_ERROR),
    ("abort_is_cascade_of_timeout", [WATCHDOG, "RuntimeError: NCCL communicator was aborted on rank 3."], CrashClass.NCCL_TIMEOUT_HANG),
    ("abort_alone", ["[1,19]<stderr>:RuntimeError[1,19]<stderr>:: NCCL communicator was aborted on rank 19."], CrashClass.NCCL_ERROR),
    ("timeout_beats_sigkill", [WATCHDOG, "  exitcode  : -9 (pid: 1)"], CrashClass.NCCL_TIMEOUT_HANG),
    ("sigterm_only_is_other", ["Sending process 9990 closing signal SIGTERM", "  exitcode  : -15 (pid: 9990)",
                               "  traceback : Signal 15 (SIGTERM) received by PID 9990"], CrashClass.OTHER),
    ("torchrun_escalation_not_host_oom", ["Unable to shutdown process 1 via Signals.SIGTERM, forcefully exiting via Signals.SIGKILL"],
     CrashClass.OTHER),
    ("kernel_oom_kill_beats_nccl", ["[rank4]: RuntimeError: DataLoader worker (pid 3) is killed by signal: Killed. ", WATCHDOG],
     CrashClass.HOST_OOM_KILLED),
    ("dmesg_oom_killer", ["Out of memory: Killed process 4412 (python) total-vm:912345678kB"], CrashClass.HOST_OOM_KILLED),
    ("killed_alone", ["Loading checkpoint shards:  40%|████      | 2/5 [00:30<00:45, 15.0s/it]", "Killed"], CrashClass.HOST_OOM_KILLED),
    ("deepspeed_minus_9", ["[ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py'] exits with return code = -9"],
     CrashClass.HOST_OOM_KILLED),
    ("user_error_beats_launcher_kill", ["ValueError: bad config", "[INFO] [launch.py:319:sigkill_handler] Killing subprocess 2231"],
     CrashClass.OTHER),
    # /dev/shm exhausted is a full (memory-backed) disk, whichever component reports it (issue 24).
    ("dev_shm_is_disk_full", ["node:1:2 [0] include/shm.cc:28 NCCL WARN Call to posix_fallocate failed : No space left on device",
                              "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error."],
     CrashClass.DISK_FULL),
    ("nccl_shm_extend", ["n:1:2 [0] misc/shmutils.cc:71 NCCL WARN Error: failed to extend /dev/shm/nccl-fjwOOB to 5967876 bytes",
                         "ncclInternalError: Internal check failed."], CrashClass.DISK_FULL),
    ("dataloader_bus_error", [PROGRESS % 3, ("RuntimeError: DataLoader worker (pid 11) is killed by signal: Bus error. It is "
                              "possible that dataloader's workers are out of shared memory."), WATCHDOG], CrashClass.DISK_FULL),
    ("torch_shm_file", ["RuntimeError: unable to write to file </torch_8289_606636967_0>: No space left on device (28)"],
     CrashClass.DISK_FULL),
    ("nccl_shm_attach_missing_is_not_disk", [("n:1:2 [0] NCCL WARN Error while attaching to shared memory segment "
                                              "/dev/shm/nccl-x (size 192814336), error: No such file or directory (2)")],
     CrashClass.NCCL_ERROR),
    ("dataloader_segfault_is_not_disk", ["RuntimeError: DataLoader worker (pid 7) is killed by signal: Segmentation fault."],
     CrashClass.OTHER),
    ("enospc_during_save", ["OSError: [Errno 28] No space left on device: '/ckpt/checkpoint-100/adapter_model.safetensors'", WATCHDOG],
     CrashClass.DISK_FULL),
    ("quota", ["OSError: [Errno 122] Disk quota exceeded"], CrashClass.DISK_FULL),
    ("eio_without_save_is_not_disk", ["OSError: [Errno 5] Input/output error: '/data/shard-0001.parquet'"], CrashClass.OTHER),
    ("port_in_use_any_casing", ["RuntimeError: Address already in use"], CrashClass.PORT_IN_USE),
    ("port_eaddrnotavail_is_not_port", [("RuntimeError: The server socket has failed to listen on any local network address. "
                                         "The server socket has failed to bind to 10.0.0.9:29500 (errno: 99 - Cannot assign "
                                         "requested address).")],
     CrashClass.OTHER),
    ("port_in_nccl_info_only", ["n:1:1 [0] NCCL INFO NET/Socket : bind failed : Address already in use", "ImportError: no module"],
     CrashClass.OTHER),
    ("oom_advice_is_not_oom", ["[WARNING] to avoid CUDA out of memory errors consider --recompute-activations", "KeyError: 'x'"],
     CrashClass.OTHER),
    ("ray_host_oom", ["ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."], CrashClass.HOST_OOM_KILLED),
    ("nan_recovered_is_not_nan", ["{'loss': 1.2, 'grad_norm': nan, 'epoch': 0.1}", "{'loss': 1.1, 'grad_norm': 0.5, 'epoch': 0.2}",
                                  "ModuleNotFoundError: No module named 'foo'"], CrashClass.OTHER),
    ("nan_not_recovered", ["{'loss': 1.2, 'grad_norm': 0.5, 'epoch': 0.1}", "{'loss': nan, 'grad_norm': nan, 'epoch': 0.2}"],
     CrashClass.NAN_LOSS),
    ("grad_norm_inf", [PROGRESS % 1, "{'loss': '2.1', 'grad_norm': 'inf', 'global_step/max_steps': '2/30'}"], CrashClass.NAN_LOSS),
    ("inf_inside_words", [PROGRESS % 1, "{'loss': '7.43', 'info': 'inference', 'grad_norm': '1.5', 'mode': 'infinite_loader'}",
                          "AssertionError: user check"], CrashClass.OTHER),
    ("megatron_nan_counter", [MEGATRON % (10, "lm loss: 2.0E+00 | ", "1.0", 0, 0), MEGATRON % (20, "", "1.0", 3, 3)],
     CrashClass.NAN_LOSS),
    ("megatron_missing_loss_bf16", [MEGATRON % (10, "lm loss: 2.0E+00 | ", "1.0", 0, 0), MEGATRON % (11, "", "1.0", 0, 0)],
     CrashClass.NAN_LOSS),
    ("megatron_no_loss_ever_is_not_nan", [MEGATRON % (10, "", "1.0", 0, 0), "KeyError: 'x'"], CrashClass.OTHER),
    ("megatron_fp16_skip_is_not_nan", [MEGATRON % (10, "", "65536.0", 1, 0), MEGATRON % (20, "lm loss: 2.0E+00 | ", "32768.0", 0, 0)],
     CrashClass.OTHER),
    # A loss scale at its minimum means every step overflowed: non-finite training in other words (issue 24).
    ("deepspeed_min_loss_scale_is_nan", ["[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1",
                                         "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."],
     CrashClass.NAN_LOSS),
    ("deepspeed_overflow_alone_is_not_nan", [("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing "
                                              "to 32768"), PROGRESS % 3, "KeyError: 'x'"], CrashClass.OTHER),
    ("fairseq_min_loss_scale", ["FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding."],
     CrashClass.NAN_LOSS),
    ("apex_scale_decayed", ["Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 1.9934389902195135e-205"],
     CrashClass.NAN_LOSS),
    ("apex_scale_decay_recovered", ["Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 6.103515625e-05",
                                    "{'loss': 1.1, 'grad_norm': 0.5, 'epoch': 0.2}", "KeyError: 'x'"], CrashClass.OTHER),
    ("apex_normal_scale_is_not_nan", ["Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0",
                                      "KeyError: 'x'"], CrashClass.OTHER),
    ("outputs_are_nan_guard", ["ValueError:Network outputs is NAN! Stop Training"], CrashClass.NAN_LOSS),
    ("detectron2_loss_infinite", ["FloatingPointError: Loss became infinite or NaN at iteration=166!"], CrashClass.NAN_LOSS),
    ("multinomial_nan_guard", ["RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"],
     CrashClass.NAN_LOSS),
    ("distribution_real_constraint", [("ValueError: Expected parameter loc (Tensor of shape (128, 10)) of distribution "
                                       "Normal(loc: torch.Size([128, 10])) to satisfy the constraint Real(), but found invalid values:")],
     CrashClass.NAN_LOSS),
    ("nan_advice_is_not_nan", ["Please check whether your inputs or outputs contain NaN values.", "KeyError: 'x'"],
     CrashClass.OTHER),
    ("argparse", ["train.py: error: unrecognized arguments: --foo 1"], CrashClass.OTHER),
    ("accelerate_port_check", [("ConnectionError: Tried to launch distributed communication on port `29500`, but another process "
                               "is utilizing it. Please specify a different port (such as using the `--main_process_port` flag)")],
     CrashClass.PORT_IN_USE),
    ("megatron_unexpected_inf", [("RuntimeError: Rank 3, node n, device 3, iteration 9: Unexpected result inf "
                                 "(message='found Inf in local grad norm for bucket #0')")], CrashClass.NAN_LOSS),
    ("nccl_warn_noise_below_user_error", ["n:1:2 [0] NCCL WARN NET/Plugin : Plugin load returned 2 : libnccl-net.so",
                                          "KeyError: 'input_ids'"], CrashClass.OTHER),
    ("nccl_warn_alone", ["n:1:2 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer with error 12"],
     CrashClass.NCCL_ERROR),
    ("docker_exit_137", ["training container exited with code 137"], CrashClass.HOST_OOM_KILLED),
    ("k8s_oomkilled", ["Last State: Terminated  Reason: OOMKilled  Exit Code: 137"], CrashClass.HOST_OOM_KILLED),
    ("hf_hub_disk", ["OSError: Not enough free disk space to download the file. The expected file size is: 4920.00 MB."],
     CrashClass.DISK_FULL),
    ("xid", ["NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE (double bit error) ECC error"], CrashClass.CUDA_FATAL),
    ("xid_lowercase_word_is_not_xid", ["xid=12 trace id", "NameError: name 'x' is not defined"], CrashClass.OTHER),
    ("empty", [], CrashClass.OTHER),
    # Peers of a rank that died (host kill, user error) report remote errors or time out: the death is the root.
    ("host_kill_beats_peer_remote_error", [PROGRESS % 3, REMOTE, "  exitcode  : -9 (pid: 1)"], CrashClass.HOST_OOM_KILLED),
    ("user_error_beats_peer_remote_error", [PROGRESS % 3, "[rank3]: KeyError: 'input_ids'", REMOTE], CrashClass.OTHER),
    ("user_error_beats_peer_watchdog", [PROGRESS % 3, "[rank3]: TypeError: bad operand", WATCHDOG], CrashClass.OTHER),
    ("user_error_before_progress_is_not_root", ["ModuleNotFoundError: No module named 'apex'", PROGRESS % 3, WATCHDOG],
     CrashClass.NCCL_TIMEOUT_HANG),
    ("remote_error_alone", [PROGRESS % 3, REMOTE], CrashClass.NCCL_ERROR),
    ("hard_nccl_error_beats_user_error", ["ValueError: x", "ncclSystemError: System call (e.g. socket, malloc) failed."],
     CrashClass.NCCL_ERROR),
    # Other crash signals are not host kills; nor is DeepSpeed's child cleanup when it names another exit code.
    ("segfault_exitcode", ["  exitcode  : -11 (pid: 1)", "  traceback : Signal 11 (SIGSEGV) received by PID 1"], CrashClass.OTHER),
    ("deepspeed_kill_then_return_code_1", ["[INFO] [launch.py:315:sigkill_handler] Killing subprocess 2",
                                          "[ERROR] [launch.py:321:sigkill_handler] ['python'] exits with return code = 1"],
     CrashClass.OTHER),
    ("deepspeed_return_code_11", ["[ERROR] [launch.py:321:sigkill_handler] ['python'] exits with return code = -11"], CrashClass.OTHER),
    ("job_control_killed", ["[1]+  Killed                  nohup python train.py > log 2>&1"], CrashClass.HOST_OOM_KILLED),
    ("exit_status_minus_9", ["subprocess.CalledProcessError: Command '['python']' returned non-zero exit status -9."],
     CrashClass.HOST_OOM_KILLED),
    # Wording variants.
    ("triton_cuda_oom", [PROGRESS % 3, "RuntimeError: Triton Error [CUDA]: out of memory"], CrashClass.OOM_DURING_TRAINING),
    ("cuda_driver_oom_is_not_fatal", [PROGRESS % 3, "RuntimeError: CUDA driver error: out of memory"], CrashClass.OOM_DURING_TRAINING),
    ("old_nccl_error_number", ["RuntimeError: NCCL Error 3: internal error"], CrashClass.NCCL_ERROR),
    ("cupy_nccl_error", ["NcclError: NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error"], CrashClass.NCCL_ERROR),
    ("thc_cuda_runtime_error_2", ["THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=58 error=2 : out of memory",
                                  "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/THCStorage.cu:58"],
     CrashClass.COLD_START_OOM),
    ("thc_other_error_is_not_oom", ["THCudaCheck FAIL file=/pytorch/aten/src/THC/THCGeneral.cpp line=383 error=11 : invalid argument",
                                    "KeyError: 'x'"], CrashClass.OTHER),
    ("timeout_at_nccl_work", [("[rank12]:[E218 04:54:23.3 ProcessGroupNCCL.cpp:1844] [PG ID 13 PG GUID 143 Rank 0] Timeout at NCCL "
                               "work: 87, last enqueued NCCL work: 87, last completed NCCL work: 86."),
                              "[rank12]: Some NCCL operations have failed or timed out."], CrashClass.NCCL_TIMEOUT_HANG),
    # Catalogue wordings (PyTorch, Lightning, Keras, TensorFlow/XLA, Windows sockets) of the same families.
    ("blocking_wait_timeout", [("[rank3]:[E1002 18:16:40.7 ProcessGroupNCCL.cpp:756] [Rank 3] Work WorkNCCL(SeqNum=2521, "
                                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) timed out in blocking wait.")],
     CrashClass.NCCL_TIMEOUT_HANG),
    ("dump_signal_timeout_is_a_cascade", [PROGRESS % 3, f"[rank3]: {OOM}",
                                          ("[rank6]:[E606 09:09:08.1 ProcessGroupNCCL.cpp:1987] [PG ID 0 Rank 6] Received a dump "
                                           "signal due to a collective timeout from rank 3 and we will try our best to dump the "
                                           "debug info.")], CrashClass.OOM_DURING_TRAINING),
    ("tf_oom_when_allocating", [("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor "
                                 "with shape[4096,4096] and type float on /job:localhost/replica:0/task:0/device:GPU:0")],
     CrashClass.COLD_START_OOM),
    ("xla_resource_exhausted", [PROGRESS % 2, ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                                "trying to allocate 8589934592 bytes.")], CrashClass.OOM_DURING_TRAINING),
    ("torch_shm_allocate", [("RuntimeError: unable to allocate shared memory(shm) for file </torch_4304_2962414746_0>: "
                             "Resource temporarily unavailable (11)")], CrashClass.DISK_FULL),
    ("windows_port_in_use", [("OSError: [WinError 10048] Only one usage of each socket address (protocol/network address/port) "
                             "is normally permitted")], CrashClass.PORT_IN_USE),
    ("lightning_early_stopping_not_finite", [("Monitored metric val_loss = nan is not finite. Previous best value was 0.412. "
                                              "Signaling Trainer to stop.")], CrashClass.NAN_LOSS),
    ("keras_terminate_on_nan", ["Batch 812: Invalid loss, terminating training"], CrashClass.NAN_LOSS),
    ("tensorboard_nan_warning", [PROGRESS % 3, "Warning: NaN or Inf found in input tensor."], CrashClass.NAN_LOSS),
    ("tensorboard_nan_warning_recovered", ["Warning: NaN or Inf found in input tensor.", PROGRESS % 4, "KeyError: 'x'"],
     CrashClass.OTHER),
    ("port_permission_denied_is_not_port", [("torch.distributed.DistNetworkError: The server socket has failed to listen on any "
                                             "local network address. The server socket has failed to bind to [::]:98 (errno: 13 - "
                                             "Permission denied).")], CrashClass.OTHER),
    ("store_socket_timeout", ["torch.distributed.DistStoreError: Socket Timeout"], CrashClass.NCCL_TIMEOUT_HANG),
    ("client_socket_timeout", ["DistNetworkError: The client socket has timed out after 900000ms while trying to connect to (n, 29500)."],
     CrashClass.NCCL_TIMEOUT_HANG),
    ("monitored_barrier", ["RuntimeError: Rank 0 failed to pass monitoredBarrier in 1800000 ms"], CrashClass.NCCL_TIMEOUT_HANG),
    ("loss_has_nans", ["Loss 6dd35fca has NaNs"], CrashClass.NAN_LOSS),
    ("lightning_bar_loss_nan", ["Epoch 1: 100%|██████████| 10/10 [00:01<00:00, 9.5it/s, loss=2.3, v_num=0]",
                                "Epoch 2:  40%|████      | 4/10 [00:01<00:01, 9.5it/s, loss=nan, v_num=0]"], CrashClass.NAN_LOSS),
    ("lightning_bar_nan_recovered", ["Epoch 1:  40%|████      | 4/10 [00:01<00:01, 9.5it/s, loss=nan, v_num=0]",
                                     "Epoch 1:  50%|█████     | 5/10 [00:01<00:01, 9.5it/s, loss=2.1, v_num=0]", "KeyError: 'x'"],
     CrashClass.OTHER),
    ("triton_out_of_resource_is_not_oom", ["triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 131072"],
     CrashClass.OTHER),
    # Wording families seen in real pastes: zsh job lines, localized shells, Ray's memory monitor, NCCL carrying
    # a CUDA driver failure, bracketed progress fields.
    ("zsh_job_killed_with_pid", ["[1]    26478 killed     python train.py"], CrashClass.HOST_OOM_KILLED),
    ("localized_shell_killed", ["step 12 loss 2.1", "Getötet"], CrashClass.HOST_OOM_KILLED),
    ("killed_inside_a_word_is_not_a_kill", ["ValueError: Getötet is not a config key"], CrashClass.OTHER),
    ("ray_memory_pressure", ["(raylet) 2 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed"],
     CrashClass.HOST_OOM_KILLED),
    ("ray_oom_prevention_advice", [("Refer to the documentation on how to address the out of memory issue: "
                                    "https://docs.ray.io/en/latest/ray-core/scheduling/ray-oom-prevention.html.")],
     CrashClass.HOST_OOM_KILLED),
    ("nccl_carries_cuda_unknown_error", ["torch.distributed.DistBackendError: NCCL error in: x.cpp:77, unhandled cuda error",
                                         "ncclUnhandledCudaError: Call to CUDA function failed.", "Last error:",
                                         "Cuda failure 999 'unknown error'"], CrashClass.CUDA_FATAL),
    ("driver_api_launch_failed", ["E cuda_driver.cc:1011] could not synchronize on CUDA context: CUDA_ERROR_LAUNCH_FAILED ::"],
     CrashClass.CUDA_FATAL),
    ("nccl_plain_cuda_failure_is_nccl", ["ncclUnhandledCudaError: Call to CUDA function failed.", "Last error:",
                                         "Cuda failure 'invalid argument'"], CrashClass.NCCL_ERROR),
    ("bracketed_loss_nan", ["| E5 iter[ 14/ 15] | [Loss] 5.1 | [step] 89 |", "| E6 iter[ 14/ 15] | [Loss] nan | [step] 104 |"],
     CrashClass.NAN_LOSS),
    ("bracketed_loss_recovered", ["| [Loss] nan | [step] 104 |", "| [Loss] 2.5 | [step] 119 |", "KeyError: 'x'"], CrashClass.OTHER),
    ("markdown_fenced_port_error", [("```RuntimeError: The server socket has failed to listen on any local network address. "
                                     "port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use```")],
     CrashClass.PORT_IN_USE),
    # A loss scale halved down to 4 or below: every recent step overflowed. One halving from 2^16 is routine.
    ("deepspeed_scale_collapse", [f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {a}, reducing to {b}"
                                  for a, b in ((16, 8), (8, 4))], CrashClass.NAN_LOSS),
    ("apex_scale_below_one", ["Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.5"], CrashClass.NAN_LOSS),
    ("deepspeed_routine_overflow", ["[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
                                    "KeyError: 'input_ids'"], CrashClass.OTHER),
    ("scale_16_is_no_collapse", ["[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 32, reducing to 16"],
     CrashClass.OTHER),
    ("scale_collapse_then_finite_progress", ["Attempted loss scale: 4, reducing to 2", "{'loss': 2.0491, 'epoch': 0.28}",
                                             "KeyError: 'x'"], CrashClass.OTHER),
    # NCCL_DEBUG=INFO's error trace (`file.cc:line -> code`) names the failure; channel lines (`0[9000] -> 1[1000]`) do not.
    ("nccl_info_error_trace", ["dgx:1050:1315 [0] NCCL INFO Channel 15/0 : 0[90000] -> 1[1000] [send] via NET/Socket/7",
                               "dgx:1050:1316 [0] NCCL INFO include/net.h:25 -> 2",
                               "dgx:1050:1316 [0] NCCL INFO transport/net.cc:515 -> 2"], CrashClass.NCCL_ERROR),
    ("nccl_info_channels_only", ["dgx:1050:1315 [0] NCCL INFO Channel 15/0 : 0[90000] -> 1[1000] [send] via NET/Socket/7",
                                 "dgx:1050:1315 [0] NCCL INFO Connected all rings", "KeyError: 'x'"], CrashClass.OTHER),
    # SIGBUS in a trainer: a /dev/shm page tmpfs could not back (UCX's handler, the shell)
    ("ucx_caught_sigbus", ["[8d6bf97c3bf4:3039 :0:3095] Caught signal 7 (Bus error: nonexistent physical address)",
                           " 2 0x000000000007587d ncclGroupEnd()  ???:0"], CrashClass.DISK_FULL),
    ("shell_bus_error", ["step 3 loss 2.0", "Bus error (core dumped)"], CrashClass.DISK_FULL),
    ("bus_error_in_a_message_is_no_signal", ["ValueError: option 'Bus error (core dumped)' unknown"], CrashClass.OTHER),
    # torch.multinomial's kernel guard: NaN probabilities, whatever device-side assert follows
    ("multinomial_nan_guard", [("/pytorch/aten/src/ATen/native/cuda/TensorCompare.cu:112: _assert_async_cuda_kernel: "
                                "block: [0,0,0], thread: [0,0,0] Assertion `probability tensor contains either `inf`, "
                                "`nan` or element < 0` failed."),
                               "RuntimeError: CUDA error: device-side assert triggered"], CrashClass.NAN_LOSS),
    ("other_kernel_assert_is_cuda_fatal", [("/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1236: indexSelectSmallIndex: "
                                            "block: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed."),
                                           "RuntimeError: CUDA error: device-side assert triggered"], CrashClass.CUDA_FATAL),
    ("categorical_logits_nan", [("ValueError: Expected parameter logits (Tensor of shape (2, 2, 50257)) of distribution "
                                 "Categorical(logits: torch.Size([2, 2, 50257])) to satisfy the constraint "
                                 "IndependentConstraint(Real(), 1), but found invalid values:"),
                                "tensor([[[nan, nan, nan,  ..., nan, nan, nan]]])"], CrashClass.NAN_LOSS),
    ("nccl_info_trace_under_an_oom", ["node:1:2 [0] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'",
                                      "node:1:2 [0] NCCL INFO include/alloc.h:110 -> 1"], CrashClass.COLD_START_OOM),
]


@pytest.mark.parametrize("lines,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_conflicts(lines: list[str], expected: CrashClass) -> None:
    assert classify("\n".join(lines) + "\n").cls is expected


# ---------------------------------------------------------------- phase and exit arguments
FLA_OOM = [
    '[rank3]:   File "/x/fla/ops/gated_delta_rule/chunk.py", line 264, in backward',
    "[rank3]:     dq, dk, dv, db, dg, dh0 = chunk_gated_delta_rule_bwd(",
    f"[rank3]: {OOM}",
]
MAMBA_OOM = ['  File "/x/mamba_ssm/ops/triton/ssd_combined.py", line 886, in backward',
             '  File "/x/mamba_ssm/ops/triton/ssd_chunk_state.py", line 900, in _chunk_state_bwd_db', OOM]
LOADER_OOM = ['  File "/x/transformers/modeling_utils.py", line 4399, in from_pretrained', "    ) = cls._load_pretrained_model(", OOM]
BACKWARD_OOM = ['  File "/x/torch/_tensor.py", line 581, in backward', "    torch.autograd.backward(", OOM]
SAVE_OOM = ['  File "/x/megatron/training/checkpointing.py", line 598, in save_checkpoint', "    x = y()", OOM]
EVAL_OOM = ['  File "/x/transformers/trainer.py", line 4154, in evaluation_loop', "    x = y()", OOM]
WRAP_OOM = ['  File "/x/transformers/trainer.py", line 2032, in _inner_training_loop', "    x = y()",
            '  File "/x/transformers/trainer.py", line 1640, in _wrap_model', "    x = y()", OOM]


@pytest.mark.parametrize("lines,phase,exit,expected", [
    ([OOM], Phase.STARTUP, None, CrashClass.COLD_START_OOM),
    ([OOM], Phase.TRAINING, None, CrashClass.OOM_DURING_TRAINING),
    ([OOM], None, None, CrashClass.COLD_START_OOM),                  # no step evidence at all
    ([PROGRESS % 1, OOM], None, None, CrashClass.OOM_DURING_TRAINING),
    (LOADER_OOM, None, None, CrashClass.COLD_START_OOM),
    (BACKWARD_OOM, None, None, CrashClass.OOM_DURING_TRAINING),
    (SAVE_OOM, None, None, CrashClass.OOM_DURING_TRAINING),        # saves follow completed steps
    (EVAL_OOM, None, None, CrashClass.OOM_DURING_TRAINING),
    (WRAP_OOM, None, None, CrashClass.COLD_START_OOM),             # model wrapping inside train() is start-up
    (["  0%|          | 0/1143 [00:00<?, ?it/s]", *BACKWARD_OOM], None, None, CrashClass.COLD_START_OOM),  # 1st step
    (["Val:   0%|          | 0/50 [00:00<?, ?it/s]", *BACKWARD_OOM], None, None, CrashClass.OOM_DURING_TRAINING),
    (["KeyError: 'x'", WATCHDOG], None, ExitStatus(signal=9), CrashClass.NCCL_TIMEOUT_HANG),
    (BACKWARD_OOM, Phase.STARTUP, None, CrashClass.COLD_START_OOM),  # the supervisor's phase is authoritative
    (FLA_OOM, Phase.STARTUP, None, CrashClass.FLA_BACKWARD_OOM),
    (FLA_OOM, Phase.TRAINING, None, CrashClass.FLA_BACKWARD_OOM),
    (MAMBA_OOM, Phase.TRAINING, None, CrashClass.OOM_DURING_TRAINING),
    (["RuntimeError: Address already in use"], Phase.TRAINING, None, CrashClass.OTHER),
    ([], None, ExitStatus(signal=9), CrashClass.HOST_OOM_KILLED),
    ([], None, ExitStatus(code=137), CrashClass.HOST_OOM_KILLED),
    ([PROGRESS % 5], Phase.TRAINING, ExitStatus.from_returncode(-9), CrashClass.HOST_OOM_KILLED),
    ([], None, ExitStatus(code=1), CrashClass.OTHER),
    ([], None, ExitStatus(signal=15), CrashClass.OTHER),
    ([OOM], None, ExitStatus(signal=9), CrashClass.COLD_START_OOM),
    (["ValueError: remaining_argv: ['--x']"], None, ExitStatus(signal=9), CrashClass.HOST_OOM_KILLED),
])
def test_phase_and_exit(lines, phase, exit, expected) -> None:
    crash = classify("\n".join(lines), exit=exit, phase=phase)
    assert crash.cls is expected
    if phase is not None:
        assert crash.phase is phase


PHASE_CASES = [
    ("swift_tf5_dict", [PROGRESS % 1], Phase.TRAINING),
    ("swift_megatron_dict", ["{'loss': 1.40617847, 'grad_norm': 0.38, 'iteration': '1/400', 'memory(GiB)': 70.12}"], Phase.TRAINING),
    ("hf_dict", ["{'loss': 1.5888, 'grad_norm': 10.75, 'learning_rate': 1e-05, 'epoch': 0.05}"], Phase.TRAINING),
    ("megatron_lm", [" iteration     3385/   10000 | consumed samples:       216640 | lm loss: 7.0E-01 |"], Phase.TRAINING),
    ("megatron_lm_timestamped", [" [2025-01-05 08:01:11] iteration       10/  100000 | consumed samples:  2560 |"], Phase.TRAINING),
    ("swift_tqdm", ["Train:  20%|██        | 6/30 [00:00<00:00, 53.37it/s]"], Phase.TRAINING),
    ("hf_tqdm_no_desc", [" 5%|▌         | 53/1000 [01:23<24:48,  1.57s/it]"], Phase.TRAINING),
    ("tqdm_cr_glued", ["Train:   0%|          | 0/30 [00:00<?, ?it/s]\rTrain:   3%|▎         | 1/30 [00:04<02:01, 4.1s/it]"], Phase.TRAINING),
    ("litgpt", ["iter 3436 step 53: loss 2.9911, iter time: 400.10ms"], Phase.TRAINING),
    ("deepspeed_step", ["[2024-01-01 00:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=0, lr=[1e-05]"], Phase.TRAINING),
    ("epoch", ["Epoch 18"], Phase.TRAINING),
    ("epoch_bracket", ["Epoch [3/100]"], Phase.TRAINING),
    ("timm_epoch0_step", ["Epoch: [0]  [ 100/1251]  eta: 0:10:01  lr: 0.000100  loss: 6.9012 (6.9101)"], Phase.TRAINING),
    ("timm_epoch0_step0", ["Epoch: [0]  [   0/1251]  eta: 2:10:01  lr: 0.000001"], Phase.UNKNOWN),
    ("generic_step_loss", ["2025-01-01 10:00:00 INFO step 53/1000 | loss=1.234 | lr=1e-5"], Phase.TRAINING),
    ("config_dump_is_not_step", ["max_steps: 1000, warmup_steps: 10, loss_type: ce, save_steps: 100"], Phase.UNKNOWN),
    ("nemo", ["[NeMo I 2025-05-01 10:01:00 nemo_logging:393] Step 3: reduced_train_loss=2.81, global_step=3"], Phase.TRAINING),
    ("verl", ["(TaskRunner pid=2231) step:12 - actor/entropy:0.51 - actor/pg_loss:0.01"], Phase.TRAINING),
    ("tqdm_desc_with_brackets", ["Train epoch [1/1]: 100%|██████████| 8/8 [00:15<00:00,  1.85s/it, act_loss=-0.7]"], Phase.TRAINING),
    ("tqdm_step_zero", ["Train:   0%|          | 0/30 [00:00<?, ?it/s]"], Phase.UNKNOWN),
    ("loading_shards_bar", ["Loading checkpoint shards:  50%|█████     | 2/4 [00:03<00:03,  1.52s/it]"], Phase.UNKNOWN),
    ("map_bar", ["Map (num_proc=8):  50%|█████     | 500/1000 [00:01<00:01, 480.21 examples/s]"], Phase.UNKNOWN),
    ("megatron_iteration_zero", [" iteration        0/   10000 | consumed samples: 0 |"], Phase.UNKNOWN),
    ("epoch_zero", ["Epoch 0"], Phase.UNKNOWN),
    ("keras_epoch_one_opens_training", ["Epoch 1/3"], Phase.UNKNOWN),
    ("nothing", ["[INFO:swift] Loading the model using model_dir: /models/x"], Phase.UNKNOWN),
]


@pytest.mark.parametrize("lines,expected", [c[1:] for c in PHASE_CASES], ids=[c[0] for c in PHASE_CASES])
def test_phase_inference(lines: list[str], expected: Phase) -> None:
    assert classify("\n".join(lines) + "\nKeyError: 'x'\n").phase is expected


# ---------------------------------------------------------------- prefix stripping
@pytest.mark.parametrize("raw,clean", [
    ("[rank3]: torch.OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA out of memory."),
    ("[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught", "[Rank 0] Watchdog caught"),
    ("[1,19]<stderr>:RuntimeError[1,19]<stderr>:: NCCL communicator was aborted", "RuntimeError: NCCL communicator was aborted"),
    ("i.pretrain/0 [default2]:[rank2]: RuntimeError: Rank 2", "RuntimeError: Rank 2"),
    ("[default0]:Traceback (most recent call last):", "Traceback (most recent call last):"),
    ("**RuntimeError: CUDA error: an illegal memory access was encountered**", "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("**ERROR:torch.x:failed (exitcode: -9) local_rank: 0 of binary:** /home/x", "ERROR:torch.x:failed (exitcode: -9) local_rank: 0 of binary: /home/x"),
    ("    return func(*args, **kwargs)", "return func(*args, **kwargs)"),
    ("W1120 22:03:44.004000 9921 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 9990 closing signal SIGTERM",
     "Sending process 9990 closing signal SIGTERM"),
    ("[W socket.cpp:426] [c10d] The server socket has failed to bind", "[c10d] The server socket has failed to bind"),
    ("2024-05-01 10:00:00,123 ERROR something failed", "ERROR something failed"),
    ("[2023-04-07 13:08:55,468] [INFO] [launch.py:318:sigkill_handler] Killing", "[INFO] [launch.py:318:sigkill_handler] Killing"),
    ("2024-05-01T10:00:00.123Z RuntimeError: x", "RuntimeError: x"),
    ("(WorkerDict pid=2231, ip=10.0.0.1) torch.OutOfMemoryError: x", "torch.OutOfMemoryError: x"),
    ("node-1: [rank8]:   File \"x.py\", line 3, in f", "File \"x.py\", line 3, in f"),
    ("Train:  33%|███▎      | 2/6 [00:00<00:00, 36.42it/s]{'loss': '7.375'}", "{'loss': '7.375'}"),
    ("Train:   3%|▎  | 1/30 [00:41<19:54, 41.2s/it]torch.OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA out of memory."),
    ("abc\rTrain:   5%|▌  | 1/20 [00:01<00:19,  1.00s/it]\rKilled", "Killed"),
    ("\x1b[31m[rank1]: torch.OutOfMemoryError: x\x1b[0m", "torch.OutOfMemoryError: x"),
    ("[1745] [rank5]:[E602 11:17:52.185 ProcessGroupNCCL.cpp:632] [Rank 5] Watchdog", "[Rank 5] Watchdog"),
    ("[1]+  Killed                  python x", "[1]+  Killed                  python x"),
    ("worker-1: KeyError: 'x'", "KeyError: 'x'"),
    ("(ActorWorker(actor_train-1) pid=18175, ip=10.0.0.2) RuntimeError: x", "RuntimeError: x"),
    ("plain line", "plain line"),
    ("`torch.cuda.OutOfMemoryError: CUDA out of memory.`", "torch.cuda.OutOfMemoryError: CUDA out of memory."),
    ("```RuntimeError: Address already in use```", "RuntimeError: Address already in use"),
    ("> Traceback (most recent call last):", "Traceback (most recent call last):"),
    ("`[36m(RayWorkerWrapper pid=4009) [rank1]: x", "x"),
])
def test_strip_prefixes(raw: str, clean: str) -> None:
    assert strip_prefixes(raw) == clean


# ---------------------------------------------------------------- table invariants and scale
def test_rule_table_is_well_formed() -> None:
    assert [r.priority for r in RULES] == sorted(r.priority for r in RULES)
    assert len({r.name for r in RULES}) == len(RULES)
    for rule in RULES:
        assert rule.patterns and rule.keywords and all(k == k.lower() for k in rule.keywords)
        assert set(rule.requires) <= set(_CONDITIONS)


def _all_lines() -> list[str]:
    files = FIXTURE_FILES + [e["root"] / e["file"] for e in ALL_REAL]
    return [strip_prefixes(line) for f in files for line in f.read_text(errors="replace").splitlines()]


def test_keywords_cover_patterns() -> None:
    """The keyword prefilter must never hide a line that a rule's patterns match."""
    lines = _all_lines() + [line for c in CASES for line in c[1]]
    for rule in RULES:
        combined = _COMPILED[rule.name][0]
        for line in lines:
            if combined.search(line):
                assert any(k in line.lower() for k in rule.keywords), (rule.name, line)


def test_root_cause_before_long_cascade_and_speed() -> None:
    progress = "".join(f"{{'loss': 1.2, 'grad_norm': 0.3, 'iteration': '{i}/90000', 'memory(GiB)': 70.1}}\n" for i in range(1, 60000))
    cascade = (WATCHDOG + "\n") * (2 * WINDOW // len(WATCHDOG) + 10)   # > WINDOW of cascade after the root
    text = progress + f"[rank3]: {OOM}\n" + cascade
    start = time.perf_counter()
    crash = classify(text)
    assert time.perf_counter() - start < 10
    assert crash.cls is CrashClass.OOM_DURING_TRAINING and crash.phase is Phase.TRAINING
    assert classify(progress + cascade).cls is CrashClass.NCCL_TIMEOUT_HANG


# ---------------------------------------------------------------- evidence when no rule decides
@pytest.mark.parametrize("lines,exit,evidence", [
    # the last exception (type and message), not the launcher chatter after it, plus the rank its prefix named
    (["[rank3]: Traceback (most recent call last):", '[rank3]:   File "x.py", line 3, in f',
      "[rank3]:     cfg.validate()", "[rank3]: omegaconf.errors.ConfigAttributeError: Key 'runner' is not in struct",
      "W1120 22:03:44.004000 9921 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 9990 closing signal SIGTERM"],
     None, ("omegaconf.errors.ConfigAttributeError: Key 'runner' is not in struct", "failing rank: 3")),
    # torchrun's summary alone: its error lines and the rank it names as the root cause
    (["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "train.py FAILED", "Root Cause (first observed failure):",
      "[0]:", "  rank      : 5 (local_rank: 5)", "  exitcode  : 2 (pid: 37881)",
      "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"], None,
     ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "train.py FAILED", "exitcode  : 2 (pid: 37881)",
      "failing rank: 5")),
    # error-looking lines without an exception type; warnings and frames are not errors
    (["UserWarning: errors ahead", "fatal: loader thread aborted", "INFO shutting down", "done."], None,
     ("fatal: loader thread aborted",)),
    # raise statements quoted under a frame are code, not the error
    (['  File "x.py", line 9, in f', "    raise SystemError('never printed')", "some failure in the data service",
      "bye"], None, ("some failure in the data service",)),
    # nothing error-looking: the last line, and how the process ended
    (["loading shards", "still loading"], ExitStatus(code=1), ("still loading", "trainer process ended with exit 1")),
    ([], None, ()),
])
def test_evidence_when_nothing_matches(lines: list[str], exit: ExitStatus | None, evidence: tuple[str, ...]) -> None:
    crash = classify("\n".join(lines), exit=exit)
    assert crash.cls is CrashClass.OTHER
    assert crash.evidence == evidence


# ---------------------------------------------------------------- a log that says why it ended (watch mode)
TQDM = "Train:  43%|████▎     | 13/30 [00:02<00:03,  5.12it/s]"
SAYS_WHY = [
    ("progress_only", [PROGRESS % 12, TQDM, PROGRESS % 13], False),
    ("nothing", [], False),
    ("startup_info_and_warnings", ["[INFO:swift] Loading the model using model_dir: /m",
                                   "UserWarning: TypedStorage is deprecated", PROGRESS % 1], False),
    ("a_traceback_no_rule_names", [PROGRESS % 3, "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                                   "KeyError: 'labels'"], True),
    ("a_rule_matches", [PROGRESS % 3, f"[rank3]: {OOM}"], True),
    ("the_shell_says_killed", [PROGRESS % 3, "Killed"], True),
    ("a_sigterm_is_logged", ["Sending process 9990 closing signal SIGTERM", "  exitcode  : -15 (pid: 9990)"], True),
    ("an_error_line", [PROGRESS % 3, "ERROR: failed to write checkpoint-10"], True),
]


@pytest.mark.parametrize("lines, expected", [c[1:] for c in SAYS_WHY], ids=[c[0] for c in SAYS_WHY])
def test_says_why(lines: list[str], expected: bool) -> None:
    """A log that ends in progress alone says nothing of why its process ended (a SIGKILL's mark when the exit
    status is unknown); an exception, a rule's match, an error-looking line say something."""
    assert says_why("\n".join(lines)) is expected
