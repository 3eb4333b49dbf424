"""Domain vocabulary shared by every module. Frozen, dependency-free: the root of the import DAG."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

GIB = 1024**3  # bytes in a GiB: the one definition


class ExitCode(IntEnum):
    """Documented process exit codes. systemd's RestartPreventExitStatus lists BAD_INPUT and GAVE_UP."""

    OK = 0            # training complete, or stopped on request (SIGTERM/SIGINT) after a graceful stop
    INTERNAL = 1      # a bug in orchestrator itself (a traceback)
    BAD_INPUT = 2     # recipe, CLI argument or checkpoint is wrong: nothing was launched
    GAVE_UP = 3       # retrying cannot help (class `other`, repeated nan_loss, no checkpoint progress, drift refused)


class State(StrEnum):
    PREFLIGHT = "preflight"
    LAUNCHING = "launching"
    RUNNING = "running"
    COMPLETED = "completed"
    CRASHED = "crashed"
    CLEANING = "cleaning"
    WAITING = "waiting"
    VERIFYING = "verifying"      # waiting for the GPUs to be clear
    RELAUNCHING = "relaunching"
    BACKOFF = "backoff"          # crash loop guard: too many crashes in the last hour
    STOPPING = "stopping"
    STOPPED = "stopped"
    GAVE_UP = "gave_up"


TERMINAL_STATES = frozenset({State.COMPLETED, State.STOPPED, State.GAVE_UP})

# The supervisor's allowed transitions: every state -> the states its handler may return (itself included
# where it stays). orchestrator/loop/supervisor.py checks each transition against this table (an unexpected one
# is a bug and raises); the README's state block and the supervisor's docstring are tested against it.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.PREFLIGHT: frozenset({State.VERIFYING, State.COMPLETED}),
    State.VERIFYING: frozenset({State.VERIFYING, State.LAUNCHING, State.RELAUNCHING, State.STOPPED}),
    State.LAUNCHING: frozenset({State.RUNNING, State.VERIFYING, State.COMPLETED, State.STOPPED, State.GAVE_UP}),
    State.RELAUNCHING: frozenset({State.RUNNING, State.VERIFYING, State.COMPLETED, State.STOPPED, State.GAVE_UP}),
    State.RUNNING: frozenset({State.RUNNING, State.CRASHED, State.COMPLETED, State.VERIFYING, State.STOPPING,
                              State.GAVE_UP}),
    State.CRASHED: frozenset({State.CLEANING}),
    State.CLEANING: frozenset({State.WAITING, State.BACKOFF, State.GAVE_UP}),
    State.WAITING: frozenset({State.WAITING, State.VERIFYING, State.STOPPED}),
    State.BACKOFF: frozenset({State.WAITING, State.VERIFYING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.COMPLETED: frozenset(),
    State.STOPPED: frozenset(),
    State.GAVE_UP: frozenset(),
}


class AttemptKind(StrEnum):
    """What one launch runs: the training, or (checkpoint.merge = "final") the export of its last checkpoint; or
    a training someone started by hand that `orchestrator watch` observes (no launch of ours)."""

    TRAIN = "train"
    EXPORT = "export"
    OBSERVED = "observed"


class CrashClass(StrEnum):
    COLD_START_OOM = "cold_start_oom"
    FLA_BACKWARD_OOM = "fla_backward_oom"
    OOM_DURING_TRAINING = "oom_during_training"
    NCCL_ERROR = "nccl_error"
    NCCL_TIMEOUT_HANG = "nccl_timeout_hang"
    PORT_IN_USE = "port_in_use"
    HOST_OOM_KILLED = "host_oom_killed"
    DISK_FULL = "disk_full"
    CUDA_FATAL = "cuda_fatal"
    NAN_LOSS = "nan_loss"
    OTHER = "other"


class Phase(StrEnum):
    """Where in the attempt a failure happened; decides e.g. cold_start_oom vs oom_during_training."""

    STARTUP = "startup"      # before the attempt's first completed training step
    TRAINING = "training"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Progress:
    """One logged training step (a stdout dict line or a logging.jsonl record)."""

    step: int
    max_steps: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    memory_gib: float | None = None
    step_s: float | None = None      # train_speed(s/it)
    skipped: int | None = None       # updates the trainer says it skipped (Megatron's `number of skipped iterations`)


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: exactly one of code / signal is set (signal for a signal death)."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, rc: int) -> ExitStatus:
        # Popen reports a signal death as -N; a shell or torchrun reports it as 128+N.
        if rc < 0:
            return cls(signal=-rc)
        return cls(code=rc)

    @property
    def killed_by(self) -> int | None:
        """The signal that ended the process, also when reported as 128+N by a wrapper."""
        if self.signal is not None:
            return self.signal
        if self.code is not None and 128 < self.code < 160:
            return self.code - 128
        return None

    def __str__(self) -> str:
        return f"signal {self.signal}" if self.signal is not None else f"exit {self.code}"


@dataclass(frozen=True)
class Crash:
    """A classified failure: the class and the log lines that decided it."""

    cls: CrashClass
    evidence: tuple[str, ...] = ()
    phase: Phase = Phase.UNKNOWN


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory found on disk and what verification said about it."""

    path: str
    step: int
    complete: bool                 # completeness markers present (a checkpoint being written is not complete)
    ok: bool                       # complete and every verification check passed
    problems: tuple[str, ...] = ()
    merged_path: str | None = None  # checkpoint-N-merged, when present
    loss: float | None = None       # the loss logged at this step, when known (for best-loss retention)


class Standing(StrEnum):
    """What a checkpoint may be used for. One owner changes it (store/standing.py), each change checked against
    STANDING_TRANSITIONS and recorded in the journal. Only `usable` ones (healthy, published) are resumed from,
    published, kept by retention as good, or merged by the final export."""

    WRITTEN = "written"        # complete on disk; verification not done yet
    VERIFIED = "verified"      # its files verified; the content check (NaN/Inf, stale copy) not done yet
    HEALTHY = "healthy"        # verified and content-checked, and no finding names it
    PUBLISHED = "published"    # healthy, and its copy on persistent storage verified
    INVALID = "invalid"        # failed verification (torn, wrong shape): never used, kept for a person
    SET_ASIDE = "set_aside"    # moved out of the checkpoint namespace, for a SetAsideReason


USABLE = frozenset({Standing.HEALTHY, Standing.PUBLISHED})

# A new save of the same step (a relaunch rewrites the checkpoints after its resume point) starts again at
# WRITTEN from any standing; the rest only move forward, or aside.
STANDING_TRANSITIONS: dict[Standing, frozenset[Standing]] = {
    Standing.WRITTEN: frozenset({Standing.VERIFIED, Standing.INVALID, Standing.SET_ASIDE}),
    Standing.VERIFIED: frozenset({Standing.HEALTHY, Standing.INVALID, Standing.SET_ASIDE}),
    Standing.HEALTHY: frozenset({Standing.PUBLISHED, Standing.SET_ASIDE}),
    Standing.PUBLISHED: frozenset({Standing.SET_ASIDE}),
    Standing.INVALID: frozenset({Standing.SET_ASIDE}),
    Standing.SET_ASIDE: frozenset(),
}


class SetAsideReason(StrEnum):
    """Why checkpoints were set aside. Each names the directory suffix the moved copies get (`tag`)."""

    NONFINITE = "nonfinite"    # a NaN or Inf in its weights (checkpoint_nonfinite)
    UNCHANGED = "unchanged"    # byte-identical to an earlier save although training went on (checkpoint_unchanged)
    NAN = "nan"                # written at or after a NaN/Inf loss or grad norm in the log
    SUSPECT = "suspect"        # the checkpoint a resume diverged from, and what that attempt saved
    DIVERGED = "diverged"      # written at or after a divergence's onset (loss_divergence, loss_limit, grad_norm_limit)

    @property
    def tag(self) -> str:
        """The suffix its moved directories carry (the names earlier releases used)."""
        return {SetAsideReason.NONFINITE: "checkpoint_nonfinite", SetAsideReason.UNCHANGED: "checkpoint_unchanged",
                SetAsideReason.DIVERGED: "suspect"}.get(self, self.value)


@dataclass(frozen=True)
class Attempt:
    """One launch of the trainer, as recorded in the journal."""

    n: int
    started_at: float
    port: int | None = None
    pid: int | None = None
    pid_start_time: float | None = None
    resumed_from: str | None = None
    start_step: int | None = None
    end_step: int | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    cls: CrashClass | None = None
    evidence: tuple[str, ...] = ()
    log_path: str | None = None
    first_step_at: float | None = None   # goodput: startup ends here
    last_step_at: float | None = None
    hang_detected_at: float | None = None
    startup_s: float | None = None       # launch -> first step record (costs.py)
    save_s: float | None = None          # mean seconds of this attempt's measured saves
    save_count: int | None = None        # how many saves save_s averages
    node: str | None = None              # multi-node: the node whose task failed first
    system: dict | None = None           # the SystemEvidence seen at the crash (dataclasses.asdict), when taken
    kind: AttemptKind = AttemptKind.TRAIN


class Action(StrEnum):
    """What the policy decides after a crash."""

    RELAUNCH = "relaunch"        # clean up, wait, verify GPUs, relaunch from the newest good checkpoint
    WAIT_FOR_SPACE = "wait_for_space"  # disk_full: no blind restart; poll free space, then relaunch
    GIVE_UP = "give_up"          # retrying cannot help


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    wait_s: float = 0.0          # settle time before verifying GPUs (wait_s, plus NCCL settle for nccl_*)
    new_port: bool = False       # pick a fresh rendezvous port (port_in_use)
    backoff_s: float = 0.0       # extra delay from the crash-loop guard
    alert: Alert | None = None   # an alert the supervisor raises with this decision (disk_full)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None = None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...] = ()
    uuid: str | None = None      # "GPU-8c4a...", for CUDA_VISIBLE_DEVICES given as UUIDs


@dataclass(frozen=True)
class GpuSnapshot:
    """What NVML said. `error` is set (and gpus empty) where no driver could be read."""

    gpus: tuple[GpuInfo, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class Check:
    """One pre-flight check result, as printed by `plan` and stored by `run`."""

    name: str
    ok: bool
    detail: str
    fatal: bool = True           # a failed fatal check stops `run` before launching


@dataclass(frozen=True)
class Command:
    """A rendered trainer launch: argv (never a shell string) and the environment it adds."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    """Where a launch resumes from. `weights_only` when the checkpoint kept no optimizer state."""

    path: str
    step: int
    weights_only: bool = False


class Alert(StrEnum):
    """The closed set of alerts. Each names one rule in monitoring/alerts.yml (its `alert` label) and
    the runbook page that rule links; tests/test_alert_rules.py keeps the three in step.

    Each alert has one owner. Most are derived by Prometheus from the metrics alone; the supervisor
    raises and clears only those in metrics.RAISED_BY_SUPERVISOR (orchestrator_alert_active{alert})."""

    CRASH_LOOP = "crash_loop"                      # crashes in 1h > orchestrator_max_crashes_per_hour
    CHECKPOINT_STALE = "checkpoint_stale"          # checkpoint age while running
    NO_TRAINING_PROGRESS = "no_training_progress"  # step timestamp while active
    CHECKPOINT_INVALID = "checkpoint_invalid"      # supervisor: newest verified checkpoint failed
    SYNC_LAGGING = "sync_lagging"                  # sync lag
    GPUS_NOT_CLEAR = "gpus_not_clear"              # verification result / time in state verifying
    NAN_OR_DIVERGENCE = "nan_or_divergence"        # NaN, nan_loss and resume divergence counters
    SUPERVISOR_DOWN = "supervisor_down"            # up / heartbeat: the supervisor cannot raise this one
    GAVE_UP = "gave_up"                            # state gave_up (every give-up path, drift included)
    DISK_FULL = "disk_full"                        # supervisor: waiting for free space
    NODE_EXCLUDED = "node_excluded"                # supervisor: a bad node left out, the Slurm job requeued
    TRAINING_UNHEALTHY = "training_unhealthy"      # health events: loss divergence, loss/grad-norm limits
    THROUGHPUT_DROP = "throughput_drop"            # supervisor: from throughput_drop to throughput_recovered
    CHECKPOINT_UNCHANGED = "checkpoint_unchanged"  # health events: a stale (byte-identical) checkpoint
    PROGRESS_UNREADABLE = "progress_unreadable"    # supervisor: progress lines the parser does not understand



class HealthKind(StrEnum):
    """Every run-health finding kind: also its journal event kind and its orchestrator_health_events_total{kind}
    label. What each raises (action, alert, extra counter, runbook, report colour) is declared once, beside it,
    in orchestrator/domain/health/kinds.py KINDS."""

    LOSS_SPIKE = "loss_spike"                        # warn: one logged loss far above its recent median
    GRAD_NORM_SPIKE = "grad_norm_spike"              # warn: the same for the grad norm
    LOSS_DIVERGENCE = "loss_divergence"              # health.on_divergence: the loss level rose and stayed up
    LOSS_LIMIT = "loss_limit"                        # health.on_divergence: over health.loss_max
    GRAD_NORM_LIMIT = "grad_norm_limit"              # health.on_divergence: over health.grad_norm_max
    RESUME_DIVERGENCE = "resume_divergence"          # the resumed losses do not continue the run's (loss check)
    RESUMED_AT_WRONG_STEP = "resumed_at_wrong_step"  # the resumed trainer's first step is not after its checkpoint
    PROGRESS_UNREADABLE = "progress_unreadable"      # warn: progress lines the parser does not understand
    THROUGHPUT_DROP = "throughput_drop"              # health.on_slowdown: steps slower than the attempt's baseline
    THROUGHPUT_RECOVERED = "throughput_recovered"    # back to the baseline
    CHECKPOINT_UNCHANGED = "checkpoint_unchanged"    # set aside: weights byte-identical to an earlier checkpoint's
    CHECKPOINT_NONFINITE = "checkpoint_nonfinite"    # set aside: a NaN or Inf in a saved tensor
    SKIPPED_STEPS = "skipped_steps"                  # warn: fp16 updates the loss scaler skipped (NaN if they persist)

# ---- system evidence: what the machine said about a failed attempt (orchestrator/host/evidence.py reads it) ----
@dataclass(frozen=True)
class OomKill:
    """A kernel record of the OOM killer killing one of the run's processes."""

    pid: int
    comm: str
    at: float                    # wall clock
    line: str                    # the kernel's line, as logged


@dataclass(frozen=True)
class GpuFault:
    """An Xid event or an ECC counter increase on one of the run's GPUs since launch."""

    gpu: int
    kind: str                    # "xid" | "ecc"
    detail: str                  # "Xid 79", "uncorrected ECC errors 0 -> 2"
    xid: int | None = None


@dataclass(frozen=True)
class DiskSpace:
    role: str                    # "output_dir", "persistent_dir", "/dev/shm"
    path: str
    free_bytes: int
    total_bytes: int
    free_inodes: int | None = None   # None: the filesystem does not count inodes (btrfs, some FUSE)


@dataclass(frozen=True)
class PortOwner:
    port: int
    pid: int | None              # None: a listener whose process this user cannot see
    cmdline: str = ""


@dataclass(frozen=True)
class SystemEvidence:
    """What the machine said at a failed attempt's end. `unavailable` names each reader that could not
    look ("kernel log: not available: ..."): absence of a record there means nothing."""

    oom_kills: tuple[OomKill, ...] = ()
    kernel_log: str | None = None        # where kernel records were read ("/dev/kmsg"); None: not read
    cgroup_oom_kills: tuple[str, ...] = ()   # "memory cgroup /x: oom_kill 0 -> 1", one per counter that rose
    gpu_faults: tuple[GpuFault, ...] = ()
    disks: tuple[DiskSpace, ...] = ()
    port_owners: tuple[PortOwner, ...] = ()
    unavailable: tuple[str, ...] = ()


# ---- slowdown evidence: what the machine said when throughput dropped (orchestrator/host/slowdown_evidence.py) ----
@dataclass(frozen=True)
class GpuHealth:
    """One GPU at a slowdown, as `nvidia-smi -q -d CLOCK,PERFORMANCE,TEMPERATURE,POWER,ECC` shows it.
    None: NVML could not say (not supported on this GPU, or the call failed)."""

    index: int
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()   # "hw_thermal_slowdown", "sw_power_cap", ... ("gpu_idle" left out)
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    ecc_uncorrected: int | None = None       # volatile (since the driver loaded)
    ecc_corrected: int | None = None
    pcie_replays: int | None = None
    xids: tuple[int, ...] = ()               # Xid events seen on it since the attempt's launch


@dataclass(frozen=True)
class CgroupCpu:
    """A CPU cgroup of the trainer's processes: its quota and throttling (v1 or v2 cpu.stat)."""

    path: str
    version: int                             # 1 or 2
    quota: str                               # "50000/100000" (us per period), "max": no limit
    nr_periods: int | None = None
    nr_throttled: int | None = None          # periods throttled, since the cgroup was made
    throttled_s: float | None = None
    throttled_now: int | None = None         # periods throttled during the sampling interval


@dataclass(frozen=True)
class SlowdownEvidence:
    """What the machine said when the trainer slowed down. Shares are of all CPUs over a short sampling
    interval; `unavailable` names each source that could not be read (absence there means nothing)."""

    at: float                                # wall clock
    gpus: tuple[GpuHealth, ...] = ()
    cpu_busy_pct: float | None = None
    cpu_steal_pct: float | None = None
    cpu_iowait_pct: float | None = None
    load_avg: tuple[float, float, float] | None = None
    memory_pressure: dict[str, float] = field(default_factory=dict)   # "some_avg10", "full_avg10", ...
    mem_available_bytes: int | None = None
    swap_used_bytes: int | None = None
    swapped_pages_per_s: float | None = None  # pswpin + pswpout over the sampling interval
    cgroups: tuple[CgroupCpu, ...] = ()
    unavailable: tuple[str, ...] = ()
