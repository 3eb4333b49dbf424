"""Crash classifier: one failed attempt's log (+ exit status, phase) -> Crash. Pure, no I/O.

Classification is data: RULES is an ordered table; the first row (by priority) with a qualifying
line wins. Root causes sit above the cascades they trigger (one rank OOMs -> the others print NCCL
aborts, watchdog timeouts, torchrun SIGTERMs), so the class is the root cause wherever it is.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from orchestrator.types import Crash, CrashClass, ExitStatus, Phase

WINDOW = 2 << 20   # the tail classified line by line
DEEP = 32 << 20    # before the tail, only fatal root causes are looked for (long cascades)
MAX_EVIDENCE = 5
_F = re.IGNORECASE | re.MULTILINE


@dataclass(frozen=True)
class Rule:
    name: str
    cls: CrashClass
    patterns: tuple[str, ...]            # any-of, searched per cleaned line, most decisive first
    keywords: tuple[str, ...] = ()       # lowercase; only lines holding one are searched (speed)
    requires: tuple[str, ...] = ()       # named line conditions (see _CONDITIONS), all must hold
    exclude: tuple[str, ...] = ()        # a line matching one of these does not count
    exit_signal: int | None = None       # also fires, without a line, when the process died of it
    priority: int = 0


_OOM = (r"CUDA out of memory", r"\btorch\.(?:cuda\.)?OutOfMemoryError\b", r"CUDA (?:driver )?error: out of memory",
        r"\[CUDA\]: out of memory", r"\bcuda\w*Malloc\w*\b.{0,60}\bout of memory",
        r"cudaErrorMemoryAllocation", r"CUDA_ERROR_OUT_OF_MEMORY", r"Cuda failure (?:2 )?'out of memory'",  # NCCL's
        r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED", r"Failed to CUDA (?:calloc|malloc)",
        r"\b(?:HIP|NPU) out of memory")
# Advice and warnings that merely mention OOM are not an OOM.
_OOM_EXCLUDE = (r"\b(?:User|Future|Deprecation)Warning\b", r"\b(?:avoid|prevent)\w* (?:an? )?(?:CUDA )?(?:OOM|out of memory)",
                r"\b(?:if|when) (?:you|it) (?:encounter|see|get|run into|hit|face)\w*\b")
_OOM_KW = ("out of memory", "out_of_memory", "outofmemoryerror", "memoryallocation", "alloc_failed", "failed to cuda")
_HYPOTHETICAL = (r"\b(?:may|might|could|can|will) (?:produce|cause|lead|result|return|give)",)   # warnings, advice
_NOT_ROOT_DISK = (r"/dev/shm", r"NCCL WARN", r"posix_fallocate", r"</torch_", r"shared memory")
_NCCL_REMOTE = r"remote process exited|ncclRemoteError|network error"      # a peer vanished (or the network)
# A process that died of SIGKILL (torchrun, DeepSpeed launcher, spawn, accelerate, shells, job control,
# containers) or exit 137. torchrun's own SIGKILL escalation after SIGTERM is teardown, not the host.
_SIGKILL = (
    r"exitcode\s*:\s*-9\b", r"Signal 9 \(SIGKILL\)", r"<Signals\.SIGKILL: 9>", r"return code = -9\b",
    r"terminated with signal SIGKILL", r"^Killed$", r"line \d+:\s+\d+ Killed\b", r"\bkilled by signal:? (?:9|SIGKILL)\b",
    r"\b(?:exit|return)\w*(?: with)?(?: exit)? (?:code|status)[ :=]*137\b", r"\bsignal: killed\b", r"\bsignal 9\b",
    r"^(?:zsh|bash|sh): killed\b", r"\btask \d+: Killed\b", r"^\[\d+\][+-]?\s+(?:\d+\s+)?Killed\b", r"\bexit status -9\b",
    r"^(?:已杀死|已殺死|強制終了|Getötet|Processus arrêté)$")
_SIGKILL_KW = ("-9", "sigkill", "killed", "137", "signal 9", "已杀死", "已殺死", "強制終了", "getötet", "processus arrêté")
_SIGKILL_EXCLUDE = (r"forcefully exiting via",)
_CLI_ERROR = (r": error: (?:unrecognized arguments|ambiguous option|argument|the following arguments)", r"remaining_argv")
_CRASH_SIGNAL = r"(?:exitcode\s*:|return code =|exit status)\s*-(?:11|7|4|8)\b"   # SIGSEGV/SIGBUS/SIGILL/SIGFPE

RULES: tuple[Rule, ...] = tuple(sorted((
    # A failed rendezvous stops everything at once. Not after a completed step (the rendezvous
    # worked then); EADDRNOTAVAIL is a wrong address, not a taken port; NCCL INFO lines are skipped.
    Rule("port_in_use", CrashClass.PORT_IN_USE, (
        r"failed to listen on any local network address", r"address already in use", r"\bEADDRINUSE\b",
        r"errno:? ?98\b", r"\[Errno 98\]", r"code: -98\b", r"another process is utilizing it", r"port \W?\d+\W? is already in use"),
        keywords=("failed to listen", "already in use", "eaddrinuse", "errno", "-98", "utilizing it"), requires=("not_training",),
        exclude=(r"Cannot assign requested address", r"EADDRNOTAVAIL", r"errno:? ?99\b"), priority=10),
    # Disk full while saving is a root cause (the other ranks then wait in a barrier). /dev/shm, NCCL
    # shm segments and DataLoader shm files say "No space left" too: IPC limits, not a full disk.
    Rule("disk_full", CrashClass.DISK_FULL, (
        r"No space left on device", r"\bENOSPC\b", r"\[Errno 28\]", r"errno:? ?28\b", r"Disk quota exceeded", r"\bEDQUOT\b",
        r"PytorchStreamWriter failed writing file", r"file write failed", r"inline_container\.cc.*unexpected pos \d+",
        r"Not enough (?:free )?disk space", r"\bStorageFull\b"),
        keywords=("no space left", "enospc", "errno", "quota exceeded", "edquot", "pytorchstreamwriter", "file write failed",
                  "unexpected pos", "disk space", "storagefull"), exclude=_NOT_ROOT_DISK, priority=20),
    # EIO inside torch.save/serialization is how a saturated disk surfaces on some filesystems.
    Rule("disk_full_io", CrashClass.DISK_FULL, (r"write\(\).*failed with Input/output error", r"Input/output error"),
         keywords=("input/output error",), requires=("save_context",), exclude=_NOT_ROOT_DISK, priority=21),
    # OOM family: fla's backward kernels first (a known spike, any phase), then start-up vs training.
    # An OOM surfacing through NCCL ("Cuda failure 'out of memory'", CUBLAS alloc) is still the OOM.
    Rule("fla_backward_oom", CrashClass.FLA_BACKWARD_OOM, _OOM, keywords=_OOM_KW, requires=("fla_context",),
         exclude=_OOM_EXCLUDE, priority=30),
    Rule("cold_start_oom", CrashClass.COLD_START_OOM, _OOM, keywords=_OOM_KW, requires=("startup_context",),
         exclude=_OOM_EXCLUDE, priority=31),
    Rule("oom_during_training", CrashClass.OOM_DURING_TRAINING, _OOM, keywords=_OOM_KW, exclude=_OOM_EXCLUDE, priority=32),
    # Fatal CUDA/hardware faults, also when an NCCL error carries them (NCCL is only the messenger).
    Rule("cuda_fatal", CrashClass.CUDA_FATAL, (
        r"illegal memory access", r"uncorrectable (?:ECC|NVLink) error", r"cudaErrorECCUncorrectable", r"(?-i:\bXid\b)",
        r"unspecified launch failure", r"cudaErrorLaunchFailure", r"device-side assert triggered",
        r"\.cu:\d+: .*Assertion .* failed", r"CUDA error: an illegal instruction", r"misaligned address",
        r"fallen off the bus", r"GPU is lost", r"cudaErrorIllegalAddress", r"CUDA_ERROR_ILLEGAL_ADDRESS",
        r"CUDA driver error", r"\bCUDA (?:error|failure)\W+(?:\d+\W+)?unknown error", r"launch timed out and was terminated",
        r"\bCUDA_ERROR_(?:LAUNCH_FAILED|ECC_UNCORRECTABLE|ILLEGAL_ADDRESS|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS"
        r"|HARDWARE_STACK_ERROR|UNKNOWN)\b",
        r"\bcudaError(?:LaunchFailure|IllegalInstruction|MisalignedAddress|HardwareStackError|Unknown)\b",
        r"CU(?:BLAS|DNN)_STATUS_EXECUTION_FAILED"),
        keywords=("illegal", "uncorrectable", "xid", "launch failure", "device-side assert", "assertion", "misaligned",
                  "fallen off the bus", "gpu is lost", "cuda driver error", "unknown error", "launch timed out",
                  "execution_failed", "cuda_error_", "cudaerror"), priority=40),
    # The kernel, cgroup or Ray naming a host-OOM kill is a root cause (its NCCL fallout is not).
    Rule("host_oom_kernel", CrashClass.HOST_OOM_KILLED, (
        r"Out of memory: Kill(?:ed)? process", r"\bOOM[-_ ]?kill(?:ed|er)?\b", r"task \d+: Out Of Memory",
        r"killed by the cgroup out-of-memory handler", r"Memory cgroup out of memory",
        r"DataLoader worker \(pid \d+\) is killed by signal: Killed", r"ray\.exceptions\.OutOfMemoryError",
        r"killed due to (?:memory pressure|the node running low on memory)", r"\bray-oom-prevention\b"),
        keywords=("out of memory", "oom", "out-of-memory", "killed by signal", "outofmemoryerror", "memory pressure",
                  "low on memory"), priority=45),
    # Explicit NaN raises (Megatron/NeMo rerun state machine, anomaly mode, clip_grad_norm_) always count.
    Rule("nan_raised", CrashClass.NAN_LOSS, (
        r"Unexpected result (?:nan|inf)\b", r"\bfound (?:a )?(?:nan|inf)\b", r"Rerun state machine.*\bnan\b",
        r"\bloss (?:is|became|was) (?:nan|inf)\b", r"\bnan (?:loss|gradients?) (?:detected|found|encountered)\b",
        r"returned nan values in its", r"is non-finite, so it cannot be clipped", r"\bdetected (?:a )?nan\b",
        r"\b(?:loss|grad\w*)\b.{0,40}\b(?:is|are|became|returned|contains?|has) (?:a |an )?(?:nans?|infs?|non-finite)\b",
        r"\bnan (?:loss|gradients?|grad norm)\b"),
        keywords=("nan", "inf", "non-finite"), exclude=_HYPOTHETICAL, priority=50),
    # NaN/Inf in progress lines counts only when no finite progress line follows (fp16 overflow steps
    # recover; a DeepSpeed OVERFLOW is not a NaN).
    Rule("nan_progress", CrashClass.NAN_LOSS, (
        r"""['"]?\b\w*(?:loss|grad_norm)['"]?\s*[:=]\s*['"]?[-+]?(?:nan|inf(?:inity)?)\b""",
        r"\b(?:lm loss|grad norm)\s*:\s*[-+]?(?:nan|inf)\b", r"\bstep \d+: loss [-+]?(?:nan|inf)\b",
        r"\[\s*\w*(?:loss|grad[_ ]norm)\s*\]\s*[:=]?\s*[-+]?(?:nan|inf)\b",
        r"number of nan iterations:\s*[1-9]"),
        keywords=("nan", "inf"), requires=("no_recovery",), exclude=_HYPOTHETICAL, priority=51),
    # Megatron-LM omits 'lm loss' when its average is NaN: after lines that had a loss, an iteration
    # line at loss scale 1.0 (bf16: no overflow skipping) without any '... loss:' field is a NaN.
    Rule("nan_missing_loss", CrashClass.NAN_LOSS,
         (r"^(?!.*\bloss:)(?:.*\s)?iteration\s+\d+\s*/\s*\d+\s*\|.*\|\s*loss scale: 1\.0\b",),
         keywords=("loss scale: 1.0",), requires=("after_finite",), priority=52),
    # Hard NCCL errors name a local transport/CUDA failure, so they outrank the timeouts it causes on other ranks.
    Rule("nccl_error", CrashClass.NCCL_ERROR, (
        r"\bnccl(?:Unhandled)?(?:UnhandledCudaError|SystemError|InternalError|InvalidUsage|InvalidArgument)\b",
        r"NCCL error in:", r"NCCL error: ", r"\bNCCL Error \d+:", r"\bNCCL_ERROR_[A-Z_]+\b", r"unhandled (?:system|cuda) error",
        r"internal error - please report this issue to the NCCL developers"),
        keywords=("nccl", "unhandled system error", "unhandled cuda error"), exclude=(_NCCL_REMOTE,), priority=60),
    # A host-OOM kill of one rank makes its peers report a vanished remote (ncclRemoteError, connection
    # reset) or a user error: the kill is the root then. A collective timeout next to a kill is not
    # outranked (hung ranks get SIGKILLed after the timeout), see host_oom_killed.
    Rule("host_kill_peer", CrashClass.HOST_OOM_KILLED, _SIGKILL, keywords=_SIGKILL_KW, requires=("no_timeout",),
         exclude=_SIGKILL_EXCLUDE, priority=64),
    # A plain Python error ends the run on its rank; the other ranks then lose their peer (remote errors,
    # aborts, watchdog timeouts). Only the unambiguous user-level types, not after later progress lines.
    Rule("user_error", CrashClass.OTHER, (*_CLI_ERROR,
        r"^(?:[\w.]+\.)?(?:ModuleNotFound|Import|FileNotFound|Key|Type|Attribute|Index|Name|Value|ZeroDivision|NotImplemented"
        r"|UnboundLocal|JSONDecode|UnicodeDecode|Permission|IsADirectory|Syntax|Assertion)Error\b"),
        keywords=("error", "remaining_argv"), requires=("not_killed", "no_recovery"),
        exclude=(r"\bnan\b", r"\binf\b", r"non-finite", r"\bnccl", r"Warning\b"), priority=65),
    # ncclRemoteError: a peer vanished or the network failed. NCCL's own error when nothing above explains it.
    Rule("nccl_remote", CrashClass.NCCL_ERROR, (
        r"\bncclRemoteError\b", r"remote process exited or there was a network error", r"NCCL error in:", r"NCCL error: "),
        keywords=("nccl", "remote process exited"), priority=68),
    # A collective timeout says only that some rank stopped; it outranks just the aborts and kills it causes.
    Rule("nccl_timeout_hang", CrashClass.NCCL_TIMEOUT_HANG, (
        r"Watchdog caught collective operation timeout", r"WorkNCCL\(SeqNum=\d+.*ran for \d+ milliseconds before timing out",
        r"collective operation timeout", r"Heartbeat monitor timed out",
        r"Timed out (?:waiting|initializing|after).*(?:store|barrier|clients|recv|send|operation)",
        r"DistBackendError.*(?:timeout|timed out)", r"store->get\(.*(?:wait timeout|Socket Timeout)",
        r"wait timeout after \d+ms, keys:", r"DistStoreError: .*Timed out", r"RendezvousTimeoutError",
        r"watchdog got stuck for \d+ seconds", r"\bSocket Timeout\b", r"client socket has timed out after",
        r"waitForInput: socket .* timed out after", r"failed to pass monitoredBarrier"),
        keywords=("timeout", "timed out", "got stuck", "monitoredbarrier"), priority=70),
    # Bare SIGKILL evidence (torchrun, DeepSpeed launcher, spawn, accelerate, bash) or exit 9/137.
    # torchrun's own SIGKILL escalation after SIGTERM is teardown, not the host killing a worker.
    Rule("host_oom_killed", CrashClass.HOST_OOM_KILLED, _SIGKILL, keywords=_SIGKILL_KW, exclude=_SIGKILL_EXCLUDE,
         exit_signal=9, priority=80),
    # Cascade-only NCCL text (aborted communicator, watchdog teardown): NCCL when nothing
    # better is in the log (nccl_error__011), but below the timeout or kill it usually comes from.
    Rule("nccl_abort", CrashClass.NCCL_ERROR, (
        r"NCCL communicator was aborted", r"Process group watchdog thread terminated with exception",
        r"Some NCCL operations have failed or timed out", r"ProcessGroupNCCL.*\babort", r"\bDistBackendError\b",
        r"retrieving ncclUniqueId"),
        keywords=("nccl", "distbackenderror", "watchdog"), priority=85),
    # A user-level exception or CLI error (evidence for `other`); launcher summaries are not causes.
    Rule("other_error", CrashClass.OTHER, (*_CLI_ERROR,
        r"^(?:[\w.]+\.)?(?:ModuleNotFound|Import|FileNotFound|Assertion|Value|Key|Type|Attribute|Runtime|OS|Index|Name)Error\b",
        r"^(?:[\w.]+\.)?\w+(?:Error|Exception)\b(?::|$)", r"Segmentation fault", r"core dumped",
        _CRASH_SIGNAL, r"\bSIG(?:SEGV|BUS|ILL|FPE)\b"),
        keywords=("error", "exception", "remaining_argv", "segmentation fault", "core dumped", "exitcode", "return code",
                  "exit status", "sigsegv", "sigbus", "sigill", "sigfpe"),
        exclude=(r"ChildFailedError", r"SignalException", r"CalledProcessError", r"Warning\b"), priority=90),
    # NCCL WARN lines alone are often start-up noise (plugins, topology): weaker than a user error.
    Rule("nccl_warn", CrashClass.NCCL_ERROR, (r"NCCL WARN",), keywords=("nccl warn",), priority=92),
    # The DeepSpeed launcher kills all children after any failure: the weakest host-kill hint.
    Rule("launcher_kill", CrashClass.HOST_OOM_KILLED, (r"sigkill_handler.*Killing subprocess",),
         keywords=("killing subprocess",), requires=("no_other_exit",), priority=95),
), key=lambda r: r.priority))

# ---- line cleaning ----------------------------------------------------------------------------
_GLUED = re.compile(r"\[rank\d+\]:|\[default\d+\]:|\[\d+,\d+\]<std(?:out|err)>:")   # also mid-line (interleaved writes)
_LEADING = re.compile(r"""^\s*(?:
    \[rank\d+\]:|\[default\d+\]:|\[\d+,\d+\]<std(?:out|err)>:
  | [\w.-]+/\d+\s+(?=\[(?:default|rank)\d+\]:)                           # nemo-run 'i.pretrain/0 '
  | [\w.-]+:\s(?=\[(?:default|rank)\d+\]:)                               # pdsh 'node-1: [rank8]:'
  | (?:(?!(?:step|iter\w*|epoch|rank|batch)-)[a-z][\w.]*-\d+|(?:\d{1,3}\.){3}\d{1,3}):\s(?=\S)   # pdsh 'worker-1: '
  | \((?:[\w()\-.]+\s)?pid=\d+(?:,\s*ip=[\d.]+)?\)\s                       # ray '(TaskRunner pid=12) '
  | \[\d{1,7}\]\s+(?!(?:\d+\s+)?(?i:killed|done|exit|stopped|terminated|running|suspended)\b)(?=\S)  # line numbers '[1745] '
                                                                         # (not bash/zsh job lines '[1]  26478 killed')
  | \[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?(?:\s+|$)   # timestamps
  | \[[IWEF]\d{3,4}\s\d\d:\d\d:\d\d(?:\.\d+)?(?:\s+\d+)?\s+[\w./-]+:\d+\]\s*             # glog [E1206 ..]
  | [IWEF]\d{3,4}\s\d\d:\d\d:\d\d\.\d+\s+\d+\s+[\w./-]+:\d+\]\s*                      # torch elastic log
  | \[[IWEF]\s[\w./-]+:\d+\]\s*                                          # [E socket.cpp:462]
  | \d{1,4}:\s(?=\S)                                                     # srun --label '3: '
  | \*\*(?=\S)                                                           # markdown bold
  | `{1,3}(?=\S) | >\s(?=\S) | \[\d{1,3}(?:;\d{1,3})*m(?=\S)                 # markdown code/quote, bare ANSI
)""", re.VERBOSE)
_BOLD_END = re.compile(r"\*\*(?=\s|$)|`+$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")                                        # colour codes
_TQDM_HEAD = re.compile(r"^(?:[^|\n]{0,80}?\d{1,3}%\|[^|\n]*\|[^\[\n]*\[[^\]\n]*\])+")
_TQDM_POSTFIX = re.compile(r",\s*([^\[\]\n]*\bloss[^\[\]\n]*)\]$", re.IGNORECASE)   # '[00:10<00:00, 9.5it/s, loss=2.3]'


def strip_prefixes(line: str) -> str:
    """Drop launcher/rank/timestamp prefixes, markdown bold and glued tqdm bars from one log line."""
    return _TQDM_HEAD.sub("", _unprefix(line)).strip()


def _unprefix(line: str) -> str:      # strip_prefixes minus the tqdm part (phase inference reads bars)
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\r" in line:
        line = next((p for p in reversed(line.split("\r")) if p.strip()), "")
    for k in range(10):
        m = _LEADING.match(line)
        if m and m.end():
            line = line[m.end():]
        elif k < 9 and ("]:" in line or "<std" in line) and _GLUED.search(line):
            line = _GLUED.sub("", line)
        else:
            break
    return _BOLD_END.sub("", line).strip() if "**" in line or "`" in line else line.strip()


# ---- phase inference --------------------------------------------------------------------------
_STEP_RES = (   # group 1 = the step number (absent: any match is a step)
    re.compile(r"""['"](?:global_step/max_steps|iteration)['"]\s*:\s*['"]?\s*(\d+)\s*/\s*\d+"""),  # ms-swift
    re.compile(r"""[{,]\s*['"](?:loss|train_loss)['"]\s*:\s*['"]?[-+]?(?:\d|nan|inf)""", re.IGNORECASE),    # HF dicts
    re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|"),                                          # Megatron-LM
    re.compile(r"\biter\s+\d+\s+step\s+(\d+)\s*:"),                                              # litgpt
    re.compile(r"\bstep=(\d+), skipped=\d+"),                                                    # DeepSpeed
    re.compile(r"(?:^|\s)step:(\d+) - \S+:"),                                                    # verl
    re.compile(r"\b(?:reduced_)?train_loss[=:]\s*[-+]?\d|\bglobal_step[=:]\s*(\d+)"),              # NeMo/Lightning
    re.compile(r"^Epoch\s*[:#]?\s*\[?(?![01]\b)(\d+)\b(?!\]\s*\[)"),   # 'Epoch 18' ('Epoch 1/3' may open the 1st)
    re.compile(r"^Epoch:?\s*\[\d+\]\s*\[\s*(\d+)/\d+\]"),                                          # timm/mmcv
    re.compile(r"\b(?:step|iter(?:ation)?|epoch)\b\W{0,3}\d+.*\bloss\b\W{0,3}[-+]?\d", re.IGNORECASE),  # generic
)
_TQDM = re.compile(r"(?:^|\])([^|]{0,60}?)\s*\d{1,3}%\|[^|]*\|\s*(\d+)/\d+\s*\[[^\]]*\]")
_TQDM_TRAIN = re.compile(r"train|epoch|iter|step", re.IGNORECASE)
_TQDM_NOT = re.compile(r"eval|valid|test|load|map|token|download|generat|process|convert|sav|export|infer|"
                       r"predict|sampl|filter|shard|fetch|pack|shuffl|build|compil", re.IGNORECASE)
_DEEP_STEP_MARKS = ("global_step/max_steps", "'iteration': '", '"iteration": "', "consumed samples:", "{'loss': ", '{"loss": ')
_FINITE = re.compile(r"""['"]loss['"]\s*:\s*['"]?[-+]?\d|\blm loss:\s*[-+]?\d|\bstep \d+: loss [-+]?\d|\bloss\s*[=:]\s*[-+]?\d"""
                     r"|\[\s*loss\s*\]\s*[-+]?\d",
                     re.IGNORECASE)


def _zero_bar(line: str) -> bool:
    """A training progress bar that has not completed a step ('Train:   0%|   | 0/400 [00:00<?, ?it/s]')."""
    return any(m.group(2) == "0" and not _TQDM_NOT.search(d := m.group(1).strip()) and (not d or _TQDM_TRAIN.search(d))
               for m in _TQDM.finditer(line))


def _step_line(line: str) -> bool:
    for rx in _STEP_RES:
        m = rx.search(line)
        if m and (m.lastindex is None or int(m.group(1)) > 0):
            return True
    return any(int(m.group(2)) > 0 and not _TQDM_NOT.search(d := m.group(1).strip()) and (not d or _TQDM_TRAIN.search(d))
               for m in _TQDM.finditer(line))   # a bare bar (HF) or a training one, not 'Loading checkpoint shards'


def _infer_phase(text: str, start: int, lines: list[str]) -> tuple[Phase, str | None]:
    for s in reversed(lines):
        if ("loss" in s or "iter" in s or "step" in s or "Epoch" in s or "%|" in s) and _step_line(s):
            return Phase.TRAINING, strip_prefixes(s) or s
    if any(text.find(m, max(0, start - DEEP), start) != -1 for m in _DEEP_STEP_MARKS):
        return Phase.TRAINING, None
    return Phase.UNKNOWN, None


# ---- conditions: (ctx, line index) -> False, True, or the line that satisfied it (more evidence) ----
_FRAME_FN = re.compile(r'^File ".*", line \d+, in (\S+)')
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*:(?:\s|$)")
# flash-linear-attention frames (paths, module names, its backward kernels; not mamba_ssm's _chunk_*_bwd).
_FLA = re.compile(r"[/\\]fla[/\\]|\bfla\.(?:ops|layers|modules)\b|\bchunk_(?:gated_)?delta_rule_bwd\w*|\bchunk_bwd_d\w+"
                  r"|\bprepare_wy_repr_bwd\b")
_BWD = re.compile(r"backward|_bwd\b|_bwd_")
_SAVE = re.compile(r"torch[/.]serialization|torch\.save|\bsave_checkpoint|\bsave_pretrained|\b_save\b|safetensors|"
                   r"Saving model checkpoint", re.IGNORECASE)
# Frame names of model loading / optimizer and engine set-up; anchored, because e.g. transformers'
# load_balancing_loss_func and HF's _prepare_inputs run inside every training step.
_STARTUP_FN = re.compile(r"^(?:from_pretrained|_*load(?!_balanc)(?:_\w+)?|setup_model_and_optimizer|get_model(?:_tokenizer)?"
                         r"|model_provider\w*|build_model|initialize(?:_optimizer_states|_megatron)?|_configure_\w*optimizer"
                         r"|_configure_distributed_model|init_process_group|_broadcast_model|broadcast_params"
                         r"|_?prepare(?:_model\w*|_deepspeed|_fsdp)?|to|cuda|_apply|to_mcore|convert_hf\w*|_?init_weights"
                         r"|reset_parameters|_setup_for_real_optimizer|init_model|_build_(?:rollout|model\w*|optimizer)"
                         r"|init_workers|profile_run|determine_num_available_blocks|_initialize_kv_caches|_materialize\w*"
                         r"|_init_param_handle_from_module|_sync_module_states|_sync_params_and_buffers"
                         r"|_verify_param_shape_across_processes|_wrap_model|fully_shard|capture_model|_dummy_(?:sampler_)?run"
                         r"|_?prepare_vllm\w*)$")
_STARTUP_CODE = re.compile(r"cublasCreate|Failed to CUDA (?:calloc|malloc)|deepspeed\.initialize\(|from_pretrained\(")
# Checkpoint saves (and their async writers) and evaluations only happen after completed steps.
_TRAIN_FN = re.compile(r"backward|train_step|training_step|_inner_training_loop|forward_backward|forward_step|"
                       r"compute_loss|^train$|^step$|^forward$|^_forward$|train_one_epoch|^fit$|loss_func|save|"
                       r"update_actor|update_policy|compute_log_prob|generate_sequences|preload_tensors|evaluat|"
                       r"prediction_step|^_prepare_inputs$|_generate_and_score")
_TRAIN_CODE = re.compile(r"\.backward\(|\.train\(|train_step\(|training_step\(|saving checkpoint at iteration\s+[1-9]"
                         r"|Saving model checkpoint to|\bsave_checkpoint\(", re.IGNORECASE)


@dataclass
class _Ctx:
    lines: list[str]
    phase: Phase                 # given, or inferred from the text
    last_finite: int             # index of the last progress line with a finite loss (-1: none)
    killed: bool = False         # the process died of SIGKILL (exit status)
    zero_bar: bool = False       # with no step evidence: a training bar still at step 0
    memo: dict[str, bool] = field(default_factory=dict)   # whole-log facts, computed once

    def anywhere(self, name: str, rx: re.Pattern[str], keywords: tuple[str, ...]) -> bool:
        """Whether any line (holding one of the keywords) matches rx; cached per log."""
        if (hit := self.memo.get(name)) is None:
            hit = self.memo[name] = any(rx.search(s) for s in self.lines if any(k in s.lower() for k in keywords))
        return hit

    def window(self, i: int, before: int, after: int) -> list[str]:
        return self.lines[max(0, i - before): i + after + 1]


def _fla(ctx: _Ctx, i: int) -> bool | str:
    win = ctx.window(i, 60, 0)
    frames = [s for s in win if _FLA.search(s)]
    return bool(frames) and any(_BWD.search(s) for s in win) and frames[-1]


def _startup(ctx: _Ctx, i: int) -> bool | str:
    if ctx.phase is not Phase.UNKNOWN:
        return ctx.phase is Phase.STARTUP
    startup: bool | str = False
    training = False
    for s in ctx.window(i, 60, 40):
        fn = m.group(1) if (m := _FRAME_FN.match(s)) else ""
        if not startup and ((fn and _STARTUP_FN.search(fn)) or _STARTUP_CODE.search(s)):
            startup = s
        training = training or bool(fn and _TRAIN_FN.search(fn)) or bool(_TRAIN_CODE.search(s))
    # Loader frames win, then a training bar still at 0/N (no step completed yet: the first forward/backward
    # OOMed); with no evidence at all it is a start-up OOM too.
    return startup or ctx.zero_bar or not training


_CONDITIONS: dict[str, Callable[[_Ctx, int], bool | str]] = {
    "not_training": lambda ctx, i: ctx.phase is not Phase.TRAINING,
    "save_context": lambda ctx, i: any(_SAVE.search(s) for s in ctx.window(i, 40, 5)),
    "fla_context": _fla,
    "startup_context": _startup,
    "no_recovery": lambda ctx, i: i > ctx.last_finite,
    "after_finite": lambda ctx, i: 0 <= ctx.last_finite < i,
    "not_killed": lambda ctx, i: not ctx.killed,
    "no_timeout": lambda ctx, i: not ctx.anywhere("timeout", _COMPILED["nccl_timeout_hang"][0], _RULE_KW["nccl_timeout_hang"]),
    "no_other_exit": lambda ctx, i: not ctx.anywhere("other_exit", _OTHER_EXIT, ("return code",)),
}
_OTHER_EXIT = re.compile(r"exits with return code = (?!-9\b)-?\d+")   # DeepSpeed's launcher names the real exit

# ---- engine -----------------------------------------------------------------------------------
_RULE_KW = {r.name: r.keywords for r in RULES}
_COMPILED = {r.name: (re.compile("|".join(f"(?:{p})" for p in r.patterns), _F), [re.compile(p, _F) for p in r.patterns],
                      re.compile("|".join(r.exclude), _F) if r.exclude else None) for r in RULES}
# When the tail shows only a cascade, fatal roots are looked for in the DEEP bytes before it with
# raw str.find needles (cheap on tens of MB); the context around each first hit then goes through RULES.
_DEEP_NEEDLES = ("out of memory", "OutOfMemoryError", "_ALLOC_FAILED", "illegal memory access", "uncorrectable ECC",
                 "Xid", "device-side assert", "unspecified launch failure", "No space left", "PytorchStreamWriter",
                 "file write failed", "Disk quota exceeded")
_CASCADE = frozenset({CrashClass.NCCL_ERROR, CrashClass.NCCL_TIMEOUT_HANG, CrashClass.HOST_OOM_KILLED, CrashClass.OTHER})
_DIGITS = re.compile(r"\d+")


def classify(text: str, exit: ExitStatus | None = None, phase: Phase | None = None) -> Crash:
    """Classify one failed attempt from its combined stdout+stderr (see RULES for the order)."""
    start = max(0, len(text) - WINDOW)
    if start:
        start = text.find("\n", start) + 1 or start
    lines = _clean(text[start:])
    step_line = None
    if phase is None or phase is Phase.UNKNOWN:
        phase, step_line = _infer_phase(text, start, lines)
    crash = _run(lines, phase, exit, step_line)
    if start and crash.cls in _CASCADE and (deep := _deep_lines(text, start)):
        crash = _run(deep + lines, phase, exit, step_line)
    if crash.cls is CrashClass.OTHER and len(crash.evidence) < MAX_EVIDENCE and (rank := _failing_rank(text, lines, crash)):
        crash = Crash(crash.cls, (*crash.evidence, f"failing rank: {rank}"), crash.phase)
    return crash


def _clean(chunk: str) -> list[str]:
    # splitlines also splits tqdm's \r redraws; NCCL INFO lines never report a failure.
    return [s for s in map(_unprefix, chunk.splitlines()) if "NCCL INFO" not in s]


def _deep_lines(text: str, start: int) -> list[str]:
    lo = max(0, start - DEEP)
    out: list[str] = []
    end = lo
    for p in sorted({p for kw in _DEEP_NEEDLES if (p := text.find(kw, lo, start)) != -1}):
        a = max(text.rfind("\n", lo, max(lo, p - 8000)) + 1, end)
        b = text.find("\n", min(p + 4000, start), start)
        b = start if b == -1 else b
        if a < b:
            out += _clean(text[a:b])
            end = b
    return out


def _candidates(keywords: tuple[str, ...], low: str, starts: list[int]) -> list[int]:
    """Indices of the lines holding a keyword (str.find on the lowered text: far cheaper than regexes)."""
    found: set[int] = set()
    for kw in keywords:
        p = low.find(kw)
        while p != -1:
            i = bisect_right(starts, p) - 1
            found.add(i)
            p = low.find(kw, starts[i + 1])
    return sorted(found)


def _strip_bar(line: str) -> str:
    """A glued tqdm head goes; a bar alone keeps its loss postfix (Lightning's 'loss=nan' is the only NaN sign)."""
    head = _TQDM_HEAD.match(line)
    if not head:
        return line
    rest = line[head.end():].strip()
    return rest or ((m := _TQDM_POSTFIX.search(head.group())) and m.group(1).strip()) or ""


def _run(raw: list[str], phase: Phase, exit: ExitStatus | None, step_line: str | None) -> Crash:
    lines = [_strip_bar(s) if "%|" in s else s for s in raw]
    nan_rx = _COMPILED["nan_progress"][0]
    last_finite = next((i for i in range(len(lines) - 1, -1, -1)
                        if ("loss" in lines[i] or "Loss" in lines[i]) and _FINITE.search(lines[i])
                        and not nan_rx.search(lines[i])), -1)
    zero_bar = phase is Phase.UNKNOWN and any("%|" in s and _zero_bar(s) for s in raw)
    ctx = _Ctx(lines, phase, last_finite, killed=exit is not None and exit.killed_by == 9, zero_bar=zero_bar)
    # Source lines quoted under a traceback frame are code, not messages ("raise ValueError(...)").
    code = {i + 1 for i, s in enumerate(lines[:-1]) if s.startswith("File ") and _FRAME_FN.match(s)
            and not _EXC_LINE.match(lines[i + 1])}
    low = "\n".join(lines).lower()
    starts = list(accumulate((len(s) + 1 for s in lines), initial=0))
    for rule in RULES:
        combined, singles, exclude = _COMPILED[rule.name]
        hits: list[tuple[int, int, str]] = []      # (pattern index, line index, line): most decisive first
        extra: list[str] = []                      # lines named by conditions
        memo: dict[str, bool] = {}                 # cascades repeat the same lines rank after rank
        keys: set[str] = set()                     # the same message from 8 ranks counts once
        fails: dict[str, int] = {}
        for i in _candidates(rule.keywords, low, starts):
            s = lines[i]
            if i in code:
                continue
            if (ok := memo.get(s)) is None:
                ok = memo[s] = bool(combined.search(s)) and not (exclude and exclude.search(s))
            if not ok or (key := _DIGITS.sub("#", s)) in keys or fails.get(key, 0) > 20:
                continue
            if not all(found := [_CONDITIONS[c](ctx, i) for c in rule.requires]):
                fails[key] = fails.get(key, 0) + 1
                continue
            keys.add(key)
            extra += [f for f in found if isinstance(f, str) and f not in extra]
            hits.append((next(k for k, rx in enumerate(singles) if rx.search(s)), i, s))
        if hits:
            hits.sort()
            if step_line and rule.cls is CrashClass.OOM_DURING_TRAINING:
                extra.append(step_line)
            evidence = [s for _, _, s in hits[:MAX_EVIDENCE - min(2, len(extra))]] + extra[:2]
            return Crash(rule.cls, tuple(s[:500] for s in evidence), phase)
        if rule.exit_signal is not None and exit is not None and exit.killed_by == rule.exit_signal:
            return Crash(rule.cls, (f"trainer process ended with {exit}",), phase)
    # Nothing matched: the last error-looking lines still say more than the last line does.
    evidence = _error_lines(lines, code) or [s for s in lines[-1:] if s] or [next((s for s in reversed(lines) if s), "")]
    evidence = [s for s in evidence if s] + ([f"trainer process ended with {exit}"] if exit is not None else [])
    return Crash(CrashClass.OTHER, tuple(s[:500] for s in evidence), phase)


# ---- evidence when no rule decided: the last error-looking lines and the failing rank ------------
_EXC_TYPE = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Failure)\b(?::|$)")
_ERRORISH = re.compile(r"\b(?:errors?|failed|failure|fatal|abort(?:ed|ing)?|terminate called|segmentation fault|core dumped"
                       r"|killed|timed out|exitcode|exit code|exit status|return code)\b", re.IGNORECASE)
_NOT_ERRORISH = re.compile(r"Warning\b|^Traceback|^File \"|^frame #|^During handling|^The above exception|^\W*$"
                           r"|To enable traceback|error_file\s*:|^Root Cause\b|^Failures:", re.IGNORECASE)
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]|\[\d+,(\d+)\]<std|\bRank (\d+)\b")
_SUMMARY_RANK = re.compile(r"^rank\s*:\s*(\d+)")


def _error_lines(lines: list[str], code: set[int]) -> list[str]:
    """The last exception (type and message) and the two last other error-looking lines, in log order."""
    exc = next((i for i in range(len(lines) - 1, -1, -1) if i not in code and _EXC_TYPE.match(lines[i])), None)
    picked = {exc} if exc is not None else set()
    keys = {_DIGITS.sub("#", lines[exc])} if exc is not None else set()
    for i in range(len(lines) - 1, -1, -1):
        if len(picked) >= 3:
            break
        s = lines[i]
        if (i not in code and _ERRORISH.search(s) and not _NOT_ERRORISH.search(s)
                and (key := _DIGITS.sub("#", s)) not in keys):
            keys.add(key)
            picked.add(i)
    return [lines[i] for i in sorted(picked)]


def _failing_rank(text: str, lines: list[str], crash: Crash) -> str | None:
    """torchrun's 'Root Cause' rank, else the rank prefix the evidence lines had before cleaning."""
    if any(s.startswith("failing rank") for s in crash.evidence):
        return None
    for head in ("Root Cause", "Failures:"):     # the summary's first failure, else any failure it lists
        for i in (i for i, s in enumerate(lines) if s.startswith(head)):
            if m := next((m for t in lines[i + 1:i + 10] if (m := _SUMMARY_RANK.match(t))), None):
                return m.group(1)
    for line in crash.evidence:
        if (p := text.rfind(line[:80])) > 0:
            prefix = text[text.rfind("\n", 0, p) + 1:p]
            if m := _RANK_PREFIX.search(prefix):
                return next(g for g in m.groups() if g is not None)
    return None
