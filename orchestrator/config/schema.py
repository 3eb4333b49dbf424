"""The recipe's schema: the typed, frozen sections of a recipe file, the Recipe that holds them, and the
checks across keys that no single field shows (combination_problems). Pure: nothing here reads a file;
loading, `--set` overrides, problem reporting and the recipe hash are in recipe.py.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.config import flags


class _Combinations(ValueError):
    """Every cross-key problem of a recipe at once: [(keys involved, the first one shown; message)]."""

    def __init__(self, found: list[tuple[tuple[str, ...], str]]) -> None:
        super().__init__("; ".join(f"{keys[0]}: {msg}" for keys, msg in found))
        self.found = found


class _Section(BaseModel):
    # strict: a string where a number belongs is an error, not a silent coercion; inf/nan are never meant.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class RunSection(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    backend: Literal["megatron", "swift"] = "megatron"
    output_dir: str                      # fast local disk; the trainer's --output_dir
    persistent_dir: str | None = None    # where verified checkpoints are published
    entrypoint: list[str] | None = None  # replaces the trainer executable (numactl, srun, tests)
    on_drift: Literal["fresh", "refuse", "resume"] = "fresh"

    @field_validator("persistent_dir")
    @classmethod
    def _no_sync(cls, v: str | None) -> str | None:
        return v or None  # "" (e.g. --set run.persistent_dir="") turns sync off, never "the current directory"


class ModelSection(_Section):
    path: str
    model_type: str | None = None
    template: str | None = None
    torch_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    num_experts: int | None = Field(default=None, gt=0)  # when config.json cannot be read here


class DataSection(_Section):
    dataset: list[str] = Field(min_length=1)
    val_dataset: list[str] = []
    max_length: int = Field(default=2048, gt=0)
    packing: bool = False
    split_dataset_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    dataset_num_proc: int = Field(default=1, gt=0)
    dataloader_num_workers: int = Field(default=0, ge=0)


class ParallelSection(_Section):
    nproc_per_node: int = Field(default=8, gt=0)
    nnodes: int = Field(default=1, gt=0)   # > 1: one Slurm job step over that many nodes (docs/slurm.md)
    tensor: int = Field(default=1, gt=0)
    pipeline: int = Field(default=1, gt=0)
    context: int = Field(default=1, gt=0)
    expert: int = Field(default=1, gt=0)
    expert_tensor: int = Field(default=1, gt=0)
    sequence_parallel: bool = False
    ddp_timeout_s: int = Field(default=1800, gt=0)  # ms-swift's Megatron default (208 days) disables the watchdog

    @property
    def data_parallel(self) -> int:
        return self.nproc_per_node * self.nnodes // (self.tensor * self.pipeline * self.context)


class MemorySection(_Section):
    recompute_granularity: Literal["full", "selective", "none"] = "selective"
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = Field(default=None, gt=0)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    precision_aware_optimizer: bool = False


class LoraSection(_Section):
    rank: int = Field(default=8, gt=0)
    alpha: int = Field(default=32, gt=0)
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default=["all-linear"], min_length=1)
    target_parameters: list[str] = []    # swift backend only (transformers-5 fused experts)


class OptimSection(_Section):
    lr: float = Field(gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    warmup_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    micro_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=16, gt=0)
    epochs: float | None = Field(default=None, gt=0)
    iterations: int | None = Field(default=None, gt=0)
    seed: int = 42


class CheckpointSection(_Section):
    # A number, or "auto": chosen at every (re)launch from the measured save cost, step time and failure
    # rate (orchestrator/domain/interval.py). Operational either way: outside the recipe hash.
    save_steps: Annotated[int, Field(gt=0)] | Literal["auto"] = 100
    logging_steps: int = Field(default=1, gt=0)
    keep_optimizer: bool = True          # False renders --no_save_optim true: weights-only resume
    # The merged full model: "every_save" (--merge_lora true: a merged copy next to every checkpoint,
    # ~740 GiB for a 397B model in bf16), "final" (train with --merge_lora false, export once after the
    # last step) or "never". `merge_lora = true/false` is the deprecated spelling of every_save/never.
    merge: Literal["every_save", "final", "never"] = "never"
    keep_local: int | None = Field(default=None, gt=0)     # newest K verified local copies; unset: from the storage budget
    step_time_s: float | None = Field(default=None, gt=0)  # seconds per step for the storage budget; unset: per-model default
    save_on_stop: bool = True            # swift: --enable_jit_checkpoint (a save on SIGTERM); megatron has none
    save_total_limit: int | None = Field(default=None, ge=2)
    # megatron --async_save: the mcore shards are written by a background process while training goes on;
    # only last-checkpoint (moved once they are durable) then marks a save complete. Outside the hash.
    # With keep_optimizer = false ms-swift saves no shards and turns it off itself (nothing to overlap).
    async_save: bool = False
    # megatron --save_safetensors: the HF adapter_model.safetensors at every save, beside the mcore shards that
    # already hold the same LoRA weights (resume reads those). Unset: false for merge = "final" with
    # keep_optimizer (the export merges from the mcore checkpoint: `megatron export --mcore_adapter`; at
    # 397B that skips 28 GiB written synchronously per save), true otherwise. Outside the hash.
    save_safetensors: bool | None = None
    keep_persistent: int = Field(default=3, gt=0)  # newest K published copies (plus the best-loss one)
    sync_interval_s: float = Field(default=300, gt=0)
    # Publish the newest verified checkpoint at most this often (0: after every verified save). A crash
    # resumes from the local copies; the published ones are for losing the node. With save_steps = "auto"
    # a 397B run saves 146 GiB every few minutes: copying each would take ~0.8 GiB/s of persistent storage.
    publish_interval_s: float = Field(default=1800, ge=0)
    resume_loss_tolerance: float = Field(default=0.05, ge=0)  # relative; resume divergence check

    @field_validator("save_steps", mode="before")
    @classmethod
    def _save_steps(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError('must be a positive number of steps or "auto"')

    @model_validator(mode="before")
    @classmethod
    def _merge_lora_alias(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "merge_lora" not in data:
            return data
        data = dict(data)
        old = data.pop("merge_lora")
        if "merge" in data:
            raise ValueError("merge_lora is the deprecated name of checkpoint.merge and both are set; "
                             "keep only checkpoint.merge (merge_lora = true is \"every_save\", false is \"never\")")
        if not isinstance(old, bool):
            raise ValueError(f"merge_lora (deprecated) must be true or false, got {old!r}; "
                             "use checkpoint.merge = \"every_save\" | \"final\" | \"never\"")
        data["merge"] = "every_save" if old else "never"
        return data

    def safetensors_every_save(self, backend: str) -> bool:
        """Whether each save writes the HF adapter (megatron --save_safetensors; swift always does)."""
        if backend != "megatron":
            return True
        if self.save_safetensors is not None:
            return self.save_safetensors
        return not (self.merge == "final" and self.keep_optimizer)

    @property
    def merge_lora(self) -> bool:
        """The trainer's --merge_lora: a merged copy at every save."""
        return self.merge == "every_save"


class EnvSection(_Section):
    vars: dict[str, str] = {}
    nccl_preset: Literal["none", "pcie"] = "none"

    @field_validator("vars")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"not a valid environment variable name: {bad[0]!r}")
        return v


class SupervisorSection(_Section):
    wait_s: float = Field(default=90, ge=0)           # "verified": the upper bound; "fixed": the wait
    wait: Literal["verified", "fixed"] = "verified"   # relaunch once ready (policy.readiness_verdict) / after wait_s
    force_wait_s: float = Field(default=120, ge=0)
    grace_s: float = Field(default=30, ge=0)          # SIGTERM -> SIGKILL
    nccl_settle_s: float = Field(default=30, ge=0)    # extra wait after nccl_* for IPC cleanup
    hang_timeout_s: float = Field(default=1800, gt=0)   # "adaptive": the upper bound; "fixed": the timer
    # "adaptive": once an attempt has shown its pace (10 step gaps and a save), no new step for 5 x its longest
    # gap (at least hang_floor_s) is a hang (policy.hang_timeout); "fixed": hang_timeout_s throughout.
    hang: Literal["adaptive", "fixed"] = "adaptive"
    hang_floor_s: float = Field(default=300, gt=0)
    startup_timeout_s: float = Field(default=3600, gt=0)
    max_crashes_per_hour: int = Field(default=3, gt=0)
    max_relaunches_without_progress: int = Field(default=5, gt=0)
    backoff_max_s: float = Field(default=1800, ge=0)
    port_range: list[int] = Field(default=[29500, 29599], min_length=2, max_length=2)
    poll_s: float = Field(default=0.5, gt=0)
    min_free_gib: float = Field(default=50, ge=0)     # disk free before launching and after disk_full
    spot_notice_file: str | None = None
    spot_notice_command: list[str] | None = None
    spot_notice_pattern: str = "terminat|reclaim|interrupt"

    @field_validator("spot_notice_pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"{v!r} is not a valid regular expression ({e})") from None
        return v

    @field_validator("spot_notice_command")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not all(v)):
            raise ValueError("must be a non-empty argument list, e.g. [\"curl\", \"-sf\", \"http://...\"]")
        return v

    @field_validator("port_range")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        lo, hi = v
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError("must be [low, high] with 1024 <= low <= high <= 65535")
        return v


class GpuSection(_Section):
    check: bool = True
    clear_threshold_mib: int = Field(default=1024, ge=0)
    kill_patterns: list[str] = []         # foreign GPU holders we may kill (regex on the command line)
    capacity_gib: float | None = Field(default=None, gt=0)  # for `plan` without a GPU; NVML wins

    @field_validator("kill_patterns")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"{p!r} is not a valid regular expression ({e})") from None
        return v


class MetricsSection(_Section):
    enabled: bool = True
    listen: str = Field(default="127.0.0.1:9400", pattern=r"^\[?[0-9A-Za-z.:-]*\]?:\d{1,5}$")
    linger_s: float = Field(default=30, ge=0)  # keep serving after giving up, so a scrape sees gave_up

    @field_validator("listen")
    @classmethod
    def _port(cls, v: str) -> str:
        if not 0 <= int(v.rpartition(":")[2]) <= 65535:  # 0: any free port (tests)
            raise ValueError("port must be 0-65535")
        return v


class HealthSection(_Section):
    """Run health (domain/health/): thresholds and actions. Outside the recipe hash. The defaults raise nothing
    on the demo, the tests' normal runs and real noisy SFT series (README "Run health" says why each)."""

    # Absolute limits, the field's andon ("loss > 10", "gradient_norm > 100"): unset, as they depend on the model.
    loss_max: float | None = Field(default=None, gt=0)
    grad_norm_max: float | None = Field(default=None, gt=0)
    # Spike (a warning): above median + spike_mads x MAD of the last spike_window logged steps and above
    # spike_min_ratio x that median (grad norms: grad_norm_spike_min_ratio). A real batch-2 SFT loss reaches
    # 2.55 x its median, its grad norm 5.2 x: normal noise must not count. Before spike_window steps are in
    # (from 5 on), both bars are raised by spike_window / steps in.
    spike_window: int = Field(default=20, ge=5)
    spike_mads: float = Field(default=10.0, gt=0)
    spike_min_ratio: float = Field(default=3.0, gt=1)
    grad_norm_spike_min_ratio: float = Field(default=10.0, gt=1)
    # Divergence: the loss level (median of divergence_window logged steps) over the run's best level + max(
    # divergence_tolerance x best, divergence_min_rise) for a window; or over half that while the grad-norm level
    # rose by grad_norm_rise (relative) since the loss was at its best (grad norms grow in a normal run).
    divergence_window: int = Field(default=20, ge=3)
    divergence_tolerance: float = Field(default=0.5, gt=0)
    divergence_min_rise: float = Field(default=0.1, ge=0)   # loss units: a best of 0.05 rising to 0.08 is noise
    grad_norm_rise: float = Field(default=1.0, gt=0)
    on_divergence: Literal["stop", "rollback", "warn"] = "stop"
    # After a resume: the first resume_window logged losses against as many before the resume point (each
    # redone step against checkpoint.resume_loss_tolerance).
    resume_window: int = Field(default=10, ge=1)
    resume_level_tolerance: float = Field(default=0.5, gt=0)
    unreadable_lines: int = Field(default=3, ge=1)  # progress-looking lines in a row with no step record
    # fp16 (a loss scaler): a non-finite grad norm with a finite loss is a skipped update, an andon only after
    # more than this many in a row (domain/health/skipped_steps.py). Megatron halves its 2^32 initial scale per skip.
    max_skipped_steps: int = Field(default=50, ge=1)
    # Throughput: step time over the attempt's baseline by slowdown_ratio for slowdown_window_s; "restart":
    # graceful stop and relaunch after a verified checkpoint.
    slowdown_ratio: float = Field(default=1.5, gt=1)
    slowdown_window_s: float = Field(default=600, gt=0)
    on_slowdown: Literal["warn", "restart"] = "warn"


ExtraValue = str | int | float | bool | list[str]


class Recipe(_Section):
    run: RunSection
    model: ModelSection
    data: DataSection
    parallel: ParallelSection = ParallelSection()
    memory: MemorySection = MemorySection()
    lora: LoraSection = LoraSection()
    optim: OptimSection
    checkpoint: CheckpointSection = CheckpointSection()
    env: EnvSection = EnvSection()
    supervisor: SupervisorSection = SupervisorSection()
    gpu: GpuSection = GpuSection()
    metrics: MetricsSection = MetricsSection()
    health: HealthSection = HealthSection()
    extra_args: dict[str, ExtraValue] = {}

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        found = combination_problems(self)
        if found:
            raise _Combinations(found)
        return self


def combination_problems(r: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """Problems no single key shows: [(the keys involved, the first one shown; message)]. Pure."""
    p, m, o = r.parallel, r.memory, r.optim
    out: list[tuple[tuple[str, ...], str]] = []
    if (o.epochs is None) == (o.iterations is None):
        out.append((("optim.epochs", "optim.iterations"), "give exactly one of optim.epochs or optim.iterations"))
    # Megatron splits the whole world (every process on every node) into model-parallel groups, so a group may
    # span nodes: tensor 4 x pipeline 2 x context 2 = 16 runs on 2 nodes of 8
    world = p.nproc_per_node * p.nnodes
    what = f"{p.nproc_per_node}" + (f" x {p.nnodes} nodes = {world}" if p.nnodes > 1 else "")
    dense = p.tensor * p.pipeline * p.context
    if world % dense:
        out.append((("parallel.nproc_per_node", "parallel.tensor", "parallel.pipeline", "parallel.context"),
                    f"{what} is not divisible by tensor x pipeline x context = {dense}"))
    moe = p.expert * p.expert_tensor * p.pipeline
    if world % moe:
        out.append((("parallel.nproc_per_node", "parallel.expert", "parallel.expert_tensor", "parallel.pipeline"),
                    f"{what} is not divisible by expert x expert_tensor x pipeline = {moe}"))
    if p.sequence_parallel and p.tensor == 1:
        out.append((("parallel.sequence_parallel", "parallel.tensor"),
                    "needs parallel.tensor > 1 (ms-swift silently turns it off)"))
    if not world % dense and o.global_batch_size % (o.micro_batch_size * p.data_parallel):
        out.append((("optim.global_batch_size", "optim.micro_batch_size", "parallel"),
                    f"{o.global_batch_size} is not divisible by micro_batch_size x data-parallel size = "
                    f"{o.micro_batch_size} x {p.data_parallel}"))
    if o.min_lr > o.lr:
        out.append((("optim.min_lr", "optim.lr"), f"{o.min_lr} is larger than optim.lr {o.lr}"))
    if m.recompute_granularity != "full" and (m.recompute_method or m.recompute_num_layers):
        key = "memory.recompute_method" if m.recompute_method else "memory.recompute_num_layers"
        out.append(((key, "memory.recompute_granularity"),
                    "memory.recompute_method/recompute_num_layers need recompute_granularity = \"full\""))
    if r.run.backend == "swift":
        if p.tensor * p.pipeline * p.context * p.expert * p.expert_tensor != 1 or p.sequence_parallel:
            out.append((("parallel", "run.backend"),
                        "tensor/pipeline/context/expert parallelism needs run.backend = \"megatron\""))
        if m.optimizer_cpu_offload or m.recompute_granularity == "full":
            out.append((("memory", "run.backend"),
                        "recompute/optimizer offload settings apply to run.backend = \"megatron\""))
        if r.checkpoint.async_save:
            out.append((("checkpoint.async_save", "run.backend"), "`swift sft` has no --async_save (a megatron sft "
                        "option); set checkpoint.async_save = false or run.backend = \"megatron\""))
        if r.checkpoint.merge == "every_save":
            out.append((("checkpoint.merge", "run.backend"), "checkpoint.merge = \"every_save\": `swift sft` has no "
                        "--merge_lora; use checkpoint.merge = \"final\" (`swift export --adapters <ckpt> --merge_lora "
                        "true` after the last step)"))
    elif r.lora.target_parameters:
        out.append((("lora.target_parameters", "run.backend"),
                    "a `swift sft` option; use lora.target_modules with megatron"))
    elif o.epochs is not None and not float(o.epochs).is_integer():
        out.append((("optim.epochs",), f"megatron sft takes a whole number of epochs (--num_train_epochs is an "
                                       f"int), got {o.epochs}; use optim.iterations for a partial epoch"))
    if r.checkpoint.async_save and r.run.backend == "megatron":
        if r.checkpoint.save_total_limit is not None:
            out.append((("checkpoint.async_save", "checkpoint.save_total_limit"), "ms-swift refuses --async_save with "
                        "--save_total_limit; unset checkpoint.save_total_limit (checkpoint.keep_local prunes "
                        "verified copies instead) or set checkpoint.async_save = false"))
    c = r.checkpoint
    if c.save_safetensors is False:
        why = ("the sft's only copy of the adapter is then the mcore checkpoint: needs run.backend = \"megatron\""
               if r.run.backend != "megatron" else
               "merge = \"every_save\" writes its merged copy only with --save_safetensors true"
               if c.merge == "every_save" else
               "keep_optimizer = false resumes from the HF adapter (--adapters), which is then not written"
               if not c.keep_optimizer else None)
        if why:
            out.append((("checkpoint.save_safetensors",), f"false: {why}; remove the key (its default fits the "
                                                          f"recipe) or set it to true"))
    for key, v in r.extra_args.items():
        problem = flags.check_extra_arg(r.run.backend, key)
        if problem:
            out.append(((f"extra_args.{key}", "run.backend"), problem))
        elif v == []:
            out.append(((f"extra_args.{key}",), f"an empty list renders a bare --{key}; remove the key instead"))
    return out
