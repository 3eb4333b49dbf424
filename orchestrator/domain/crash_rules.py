"""The crash rule table: which log lines name which CrashClass, in priority order (classify.py runs it).

Data only. A rule's `requires` names line conditions that classify.py defines (_CONDITIONS). Root causes
sit above the cascades they trigger (one rank OOMs -> the others print NCCL aborts, watchdog timeouts,
torchrun SIGTERMs), so the class is the root cause wherever it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.types import CrashClass


@dataclass(frozen=True)
class Rule:
    name: str
    cls: CrashClass
    patterns: tuple[str, ...]            # any-of, searched per cleaned line, most decisive first
    keywords: tuple[str, ...] = ()       # lowercase; only lines holding one are searched (speed)
    requires: tuple[str, ...] = ()       # named line conditions (see classify._CONDITIONS), all must hold
    exclude: tuple[str, ...] = ()        # a line matching one of these does not count
    exit_signal: int | None = None       # also fires, without a line, when the process died of it
    priority: int = 0


_OOM = (r"CUDA out of memory", r"\btorch\.(?:cuda\.)?OutOfMemoryError\b", r"CUDA (?:driver )?error: out of memory",
        r"\[CUDA\]: out of memory", r"\bcuda\w*Malloc\w*\b.{0,60}\bout of memory",
        r"cudaErrorMemoryAllocation", r"CUDA_ERROR_OUT_OF_MEMORY", r"Cuda failure (?:2 )?'out of memory'",  # NCCL's
        r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED", r"Failed to CUDA (?:calloc|malloc)",
        r"\b(?:HIP|NPU) out of memory", r"\bCUDA\W{1,3}out of memory",
        r"\bcuda runtime err(?:or)?\s*\(2\)", r"\berror\s*=\s*2\s*:\s*out of memory",   # THC era: 'cuda runtime error (2)', THCudaCheck
        r"\bOOM when allocating tensor\b", r"RESOURCE_EXHAUSTED: Out of memory while trying to allocate")   # TF, XLA
# Advice and warnings that merely mention OOM are not an OOM.
_OOM_EXCLUDE = (r"\b(?:User|Future|Deprecation)Warning\b", r"\b(?:avoid|prevent)\w* (?:an? )?(?:CUDA )?(?:OOM|out of memory)",
                r"\b(?:if|when) (?:you|it) (?:encounter|see|get|run into|hit|face)\w*\b")
_OOM_KW = ("out of memory", "oom when allocating", "out_of_memory", "outofmemoryerror", "memoryallocation", "alloc_failed", "failed to cuda")
_ADVICE = (r"\b(?:check|whether|make sure|ensure|avoid|prevent)\b",)                    # 'check whether inputs contain NaN'
_HYPOTHETICAL = (r"\b(?:may|might|could|can|will) (?:produce|cause|lead|result|return|give)",)   # warnings, advice
_NOT_ROOT_DISK = (r"/dev/shm", r"NCCL WARN", r"posix_fallocate", r"</torch_", r"shared memory")   # disk_full_shm's
# /dev/shm exhausted: DataLoader workers die of SIGBUS or cannot write their shared-memory files, NCCL cannot
# create or grow its shm segments. The host ran out of a (memory-backed) filesystem, not NCCL or the user.
_SHM = (r"killed by signal: Bus error", r"Unexpected bus error encountered in worker", r"\binsufficient shared memory\b",
        r"\bout of shared memory\b", r"unable to write to file </?torch_", r"unable to allocate shared memory",
        r"failed to extend\s+/dev/shm/", r"Error while creating shared memory segment\s+(?:/dev/shm/)?\S",   # NCCL < 2.12: no path
        r"posix_fallocate failed\s*:\s*No space left", r"/dev/shm\b.*\b(?:No space left|ENOSPC|errno:? ?28)",
        # SIGBUS itself: touching a page of a /dev/shm mapping that tmpfs can no longer back (UCX's and the
        # shell's words for it); an x86 trainer has no other common way to get one
        r"\bCaught signal 7 \(Bus error", r"^Bus error(?: \(core dumped\))?$")
SHM_PATTERNS = _SHM                                   # policy tells a /dev/shm disk_full by them
_SHM_KW = ("bus error", "shared memory", "</torch_", "torch_", "/dev/shm", "posix_fallocate")
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
        r"errno:? ?98\b", r"\[Errno 98\]", r"code: -98\b", r"another process is utilizing it", r"port \W?\d+\W? is already in use",
        r"only one usage of each socket address", r"\bWSAEADDRINUSE\b", r"\b(?:errno:? ?|WinError )10048\b"),   # Windows
        keywords=("failed to listen", "already in use", "eaddrinuse", "errno", "-98", "utilizing it", "only one usage", "10048"),
        requires=("not_training",),
        exclude=(r"Cannot assign requested address", r"EADDRNOTAVAIL", r"errno:? ?99\b",   # a wrong address,
                 r"Permission denied", r"\bEACCES\b", r"errno:? ?13\b"), priority=10),         # a privileged port
    # Disk full while saving is a root cause (the other ranks then wait in a barrier). Lines about /dev/shm
    # (NCCL shm segments, DataLoader shm files) are left to disk_full_shm, which knows their own wordings.
    Rule("disk_full", CrashClass.DISK_FULL, (
        r"No space left on device", r"\bENOSPC\b", r"\[Errno 28\]", r"errno:? ?28\b", r"Disk quota exceeded", r"\bEDQUOT\b",
        r"PytorchStreamWriter failed writing file", r"file write failed", r"inline_container\.cc.*unexpected pos \d+",
        r"Not enough (?:free )?disk space", r"\bStorageFull\b"),
        keywords=("no space left", "enospc", "errno", "quota exceeded", "edquot", "pytorchstreamwriter", "file write failed",
                  "unexpected pos", "disk space", "storagefull"), exclude=_NOT_ROOT_DISK, priority=20),
    Rule("disk_full_shm", CrashClass.DISK_FULL, _SHM, keywords=_SHM_KW, exclude=(r"out of resource: shared memory",),
         priority=22),
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
    # torch.multinomial's kernel guard against NaN/Inf probabilities: the device-side assert it triggers is a
    # non-finite model output, not a fault of the GPU.
    Rule("nan_kernel_guard", CrashClass.NAN_LOSS, (r"Assertion .{0,3}probability tensor contains either .{0,3}inf",),
         keywords=("probability tensor",), priority=39),
    # Fatal CUDA/hardware faults, also when an NCCL error carries them (NCCL is only the messenger).
    Rule("cuda_fatal", CrashClass.CUDA_FATAL, (
        r"illegal memory access", r"uncorrectable (?:ECC|NVLink) error", r"cudaErrorECCUncorrectable", r"(?-i:\bXid\b)",
        r"unspecified launch failure", r"cudaErrorLaunchFailure", r"device-side assert triggered",
        r"\.cu:\d+: .*Assertion .* failed", r"CUDA error: an illegal instruction", r"misaligned address",
        r"fallen off the bus", r"GPU is lost", r"cudaErrorIllegalAddress", r"CUDA_ERROR_ILLEGAL_ADDRESS",
        r"CUDA driver error", r"\bCUDA (?:error|failure)\W+(?:\d+\W+)?unknown error", r"launch timed out and was terminated",
        (r"\bCUDA_ERROR_(?:LAUNCH_FAILED|ECC_UNCORRECTABLE|ILLEGAL_ADDRESS|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS"
         r"|HARDWARE_STACK_ERROR|UNKNOWN)\b"),
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
    # Guards in other frameworks' words count too: an fp16 loss scale that reached its minimum (every step
    # overflowed), torch.distributions / torch.multinomial refusing NaN inputs, 'outputs are NaN' checks.
    Rule("nan_raised", CrashClass.NAN_LOSS, (
        r"Unexpected result (?:nan|inf)\b", r"\bfound (?:a )?(?:nan|inf)\b", r"Rerun state machine.*\bnan\b",
        r"\bloss (?:is|became|was|has become) (?:nan|inf(?:inite)?)\b", r"\bnan (?:loss|gradients?) (?:detected|found|encountered)\b",
        r"returned nan values in its", r"is non-finite, so it cannot be clipped", r"\bdetected (?:a )?nan\b",
        (r"\b(?:loss|grad\w*|outputs?|logits?|predictions?|activations?|probabilit\w+|weights?|param\w*)\b"
         r".{0,40}\b(?:is|are|became|returned|contains?|has) (?:either |a |an )?[`'\"]?(?:nans?|infs?|infinite|non-finite)\b"),
        r"\bnan (?:loss|gradients?|grad norm)\b",
        r"\bloss scale (?:is )?already at (?:its )?minimum", r"\bminimum loss scale reached",
        r"constraint (?:IndependentConstraint\()?Real\(\)(?:, \d+\))?, but found invalid values",
        r"=\s*[-+]?(?:nan|inf)\s+is not finite", r"\bInvalid loss, terminating training"),   # Lightning EarlyStopping, Keras
        keywords=("nan", "inf", "non-finite", "minimum", "invalid values", "not finite", "invalid loss"), exclude=(*_HYPOTHETICAL, *_ADVICE), priority=50),
    # NaN/Inf in progress lines counts only when no finite progress line follows (fp16 overflow steps
    # recover; a DeepSpeed OVERFLOW is not a NaN).
    Rule("nan_progress", CrashClass.NAN_LOSS, (
        r"""['"]?\b\w*(?:loss|grad_norm)['"]?\s*[:=]\s*['"]?[-+]?(?:nan|inf(?:inity)?)\b""",
        r"\b(?:lm loss|grad norm)\s*:\s*[-+]?(?:nan|inf)\b", r"\bstep \d+: loss [-+]?(?:nan|inf)\b",
        r"\[\s*\w*(?:loss|grad[_ ]norm)\s*\]\s*[:=]?\s*[-+]?(?:nan|inf)\b",
        r"number of nan iterations:\s*[1-9]", r"\bNaN or Inf found in input tensor"),   # tensorboard(X) logging a NaN
        keywords=("nan", "inf"), requires=("no_recovery",), exclude=_HYPOTHETICAL, priority=51),
    # A dynamic loss scale halved down to 4 or below means every recent step overflowed (DeepSpeed and apex
    # start at 2^16, fairseq at 2^7; a healthy run settles far above): non-finite training, unless a finite
    # progress line follows.
    Rule("nan_loss_scale_decay", CrashClass.NAN_LOSS, (
        r"\bloss scal\w*\b.{0,40}\b(?:to|reducing to|setting loss scale to):?\s*"
        r"(?:[124](?:\.0+)?|0\.\d+|[1-9](?:\.\d+)?e-0*\d+)(?![\w.])",),
        keywords=("loss scal",), requires=("no_recovery",), priority=53),
    # Megatron-LM omits 'lm loss' when its average is NaN: after lines that had a loss, an iteration
    # line at loss scale 1.0 (bf16: no overflow skipping) without any '... loss:' field is a NaN.
    Rule("nan_missing_loss", CrashClass.NAN_LOSS,
         (r"^(?!.*\bloss:)(?:.*\s)?iteration\s+\d+\s*/\s*\d+\s*\|.*\|\s*loss scale: 1\.0\b",),
         keywords=("loss scale: 1.0",), requires=("after_finite",), priority=52),
    # Hard NCCL errors name a local transport/CUDA failure, so they outrank the timeouts it causes on other ranks.
    Rule("nccl_error", CrashClass.NCCL_ERROR, (
        r"\bnccl(?:Unhandled)?(?:UnhandledCudaError|SystemError|InternalError|InvalidUsage|InvalidArgument)\b",
        r"NCCL error in:", r"NCCL error: ", r"\bNCCL Error \d+:", r"\bNCCL_ERROR_[A-Z_]+\b", r"unhandled (?:system|cuda) error",
        r"internal error - please report this issue to the NCCL developers",
        # NCCL_DEBUG=INFO's error trace: each frame a failing call returned through, `file.cc:line -> code`
        # (1 unhandled CUDA, 2 system, 3 internal, 4 invalid argument, 5 invalid usage; 6 is a remote error)
        r"NCCL INFO [\w./-]+\.(?:cc|cu|h|cpp):\d+ -> [1-5]\s*$"),
        keywords=("nccl", "unhandled system error", "unhandled cuda error"), exclude=(_NCCL_REMOTE,), priority=60),
    # A host-OOM kill of one rank makes its peers report a vanished remote (ncclRemoteError, connection
    # reset) or a user error: the kill is the root then. A collective timeout next to a kill is not
    # outranked (hung ranks get SIGKILLed after the timeout), see host_oom_killed.
    Rule("host_kill_peer", CrashClass.HOST_OOM_KILLED, _SIGKILL, keywords=_SIGKILL_KW, requires=("no_timeout",),
         exclude=_SIGKILL_EXCLUDE, priority=64),
    # A plain Python error ends the run on its rank; the other ranks then lose their peer (remote errors,
    # aborts, watchdog timeouts). Only the unambiguous user-level types, not after later progress lines.
    Rule("user_error", CrashClass.OTHER, (*_CLI_ERROR,
        (r"^(?:[\w.]+\.)?(?:ModuleNotFound|Import|FileNotFound|Key|Type|Attribute|Index|Name|Value|ZeroDivision|NotImplemented"
         r"|UnboundLocal|JSONDecode|UnicodeDecode|Permission|IsADirectory|Syntax|Assertion)Error\b")),
        keywords=("error", "remaining_argv"), requires=("not_killed", "no_recovery"),
        exclude=(r"\bnan\b", r"\binf\b", r"non-finite", r"\bnccl", r"Warning\b"), priority=65),
    # ncclRemoteError: a peer vanished or the network failed. NCCL's own error when nothing above explains it.
    Rule("nccl_remote", CrashClass.NCCL_ERROR, (
        r"\bncclRemoteError\b", r"remote process exited or there was a network error", r"NCCL error in:", r"NCCL error: ",
        r"NCCL INFO [\w./-]+\.(?:cc|cu|h|cpp):\d+ -> 6\s*$"),
        keywords=("nccl", "remote process exited"), priority=68),
    # A collective timeout says only that some rank stopped; it outranks just the aborts and kills it causes.
    Rule("nccl_timeout_hang", CrashClass.NCCL_TIMEOUT_HANG, (
        r"Watchdog caught collective operation timeout", r"WorkNCCL\(SeqNum=\d+.*ran for \d+ milliseconds before timing out",
        r"collective operation timeout", r"Heartbeat monitor timed out",
        r"Timed out (?:waiting|initializing|after).*(?:store|barrier|clients|recv|send|operation)",
        r"DistBackendError.*(?:timeout|timed out)", r"store->get\(.*(?:wait timeout|Socket Timeout)",
        r"wait timeout after \d+ms, keys:", r"DistStoreError: .*Timed out", r"RendezvousTimeoutError",
        r"watchdog got stuck for \d+ seconds", r"\bSocket Timeout\b", r"client socket has timed out after",
        r"waitForInput: socket .* timed out after", r"failed to pass monitoredBarrier",
        r"\bTimeout at NCCL work\b", r"\btimed out in blocking wait\b", r"dump signal due to a collective timeout"),
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
