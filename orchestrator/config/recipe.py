"""Recipe: one TOML file validated into typed, frozen models; `--set` overrides; the recipe hash.

Everything here is pure except `load()`, which reads the TOML file (and the model's config.json,
to check the expert count against EP before anything runs).
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.config import flags


def _printable(text: str) -> str:
    # One line, always: a key or value holding a newline or other control character is shown escaped.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: the dotted key (None: the file as a whole), what is wrong and what
    to do, and where the bad value came from (the recipe file, or `--set 'key=value'`)."""

    key: str | None
    message: str
    source: str = "<recipe>"

    def line(self) -> str:
        return _printable(f"{self.source}: {self.message}" if self.key is None else f"{self.source}: {self.key}: {self.message}")

    def as_dict(self) -> dict:
        return {"key": None if self.key is None else _printable(self.key), "message": _printable(self.message),
                "source": _printable(self.source)}


class RecipeError(Exception):
    """Bad input: every problem, one line each, naming the file (or `--set`), the key and what to do. Exit 2."""

    def __init__(self, message: str = "", problems: Sequence[Problem] = ()) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(p.line() for p in self.problems) if self.problems else _printable(message))


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
    keep_persistent: int = Field(default=3, gt=0)  # newest K published copies (plus the best-loss one)
    sync_interval_s: float = Field(default=300, gt=0)
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
    hang_timeout_s: float = Field(default=1800, gt=0)
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
    dense = p.tensor * p.pipeline * p.context
    if p.nproc_per_node % dense:
        out.append((("parallel.nproc_per_node", "parallel.tensor", "parallel.pipeline", "parallel.context"),
                    f"{p.nproc_per_node} is not divisible by tensor x pipeline x context = {dense}"))
    moe = p.expert * p.expert_tensor * p.pipeline
    if p.nproc_per_node % moe:
        out.append((("parallel.nproc_per_node", "parallel.expert", "parallel.expert_tensor", "parallel.pipeline"),
                    f"{p.nproc_per_node} is not divisible by expert x expert_tensor x pipeline = {moe}"))
    if p.sequence_parallel and p.tensor == 1:
        out.append((("parallel.sequence_parallel", "parallel.tensor"),
                    "needs parallel.tensor > 1 (ms-swift silently turns it off)"))
    if not p.nproc_per_node % dense and o.global_batch_size % (o.micro_batch_size * p.data_parallel):
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
    for key, v in r.extra_args.items():
        problem = flags.check_extra_arg(r.run.backend, key)
        if problem:
            out.append(((f"extra_args.{key}", "run.backend"), problem))
        elif v == []:
            out.append(((f"extra_args.{key}",), f"an empty list renders a bare --{key}; remove the key instead"))
    return out


# --- loading -------------------------------------------------------------------------------------

_PATH_KEYS = (("run", "output_dir"), ("run", "persistent_dir"), ("model", "path"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`dotted.key=value`; the value is read as a TOML value, else taken as a plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", key.strip()):
        raise RecipeError(problems=[Problem(None, "expected dotted.key=value, for example --set optim.lr=1e-4",
                                            f"--set {item!r}")])
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw.strip()
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)  # not a JSON round trip: TOML has dates and times
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(problems=[Problem(None, f"{k!r} is not a table", f"--set {item!r}")])
        node[keys[-1]] = value
    return data


def _check_values(node: Any, where: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """Values no recipe key can take, whatever its type: a NUL character (no path, argument or environment
    variable can hold one), integers beyond 64 bits (TOML's limit) and nesting deeper than 8 levels (no
    recipe key is deeper than 4; deeper data would only exhaust the recursion limit later).
    -> [(dotted key, problem)]."""
    if depth > 8:
        return [(where, "nested too deeply")]
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    elif isinstance(node, str) and "\0" in node:
        return [(where, "contains a NUL character (\\x00), which no path, argument or environment variable can hold")]
    elif isinstance(node, int) and not isinstance(node, bool) and not -2**63 <= node < 2**63:
        return [(where, "integer out of the 64-bit range (TOML integers are -2**63 .. 2**63 - 1)")]
    else:
        return []
    found = []
    for k, v in items:
        key = f"{where}.{k}" if where else str(k)
        if isinstance(k, str) and "\0" in k:
            found.append((key, "a key with a NUL character (\\x00)"))
        else:
            found += _check_values(v, key, depth + 1)
    return found


def _source(keys: Sequence[str], overrides: Sequence[str], path: str) -> str:
    """Where the value behind these dotted keys came from: the last `--set` that wrote one of them (or
    a table above or below one), else the recipe file."""
    for item in reversed(overrides):
        k = item.partition("=")[0].strip()
        if any(k == key or k.startswith(f"{key}.") or key.startswith(f"{k}.") for key in keys if key):
            return f"--set {item!r}"
    return path


def _resolve_paths(data: dict, base: Path) -> None:
    """Relative paths in a recipe are relative to the recipe file (absolute for ms-swift: a missing
    relative --model is taken as a hub id and downloaded)."""
    for section, key in _PATH_KEYS:
        v = data[section].get(key) if isinstance(data.get(section), dict) else None
        if isinstance(v, str) and v and not Path(v).is_absolute():
            data[section][key] = str((base / v).resolve())
    ds = data.get("data") if isinstance(data.get("data"), dict) else {}
    for key in ("dataset", "val_dataset"):
        if isinstance(ds.get(key), list):
            ds[key] = [str((base / d).resolve()) if isinstance(d, str) and _looks_local(d) and not Path(d).is_absolute()
                       else d for d in ds[key]]


def _looks_local(d: str) -> bool:
    return d.startswith(".") or d.split("#")[0].endswith((".json", ".jsonl", ".csv"))


def _describe(err: dict, model: type[BaseModel]) -> list[tuple[tuple[str, ...], str]]:
    """One pydantic error -> [(the dotted keys involved, the first one shown; message)]."""
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, _Combinations):
        return error.found
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return [((loc,), f"unknown key{_suggest(err['loc'], model)}")]
    if err["type"] == "missing":
        return [((loc,), "required key is missing")]
    got = err.get("input")
    got_s = "" if isinstance(got, dict) else f", got {got!r}"
    return [((loc,), err["msg"].removeprefix("Value error, ") + got_s)]


def _suggest(loc: tuple, model: type[BaseModel]) -> str:
    node: Any = model
    for part in loc[:-1]:
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return ""
        node = field.annotation
    if not (isinstance(node, type) and issubclass(node, BaseModel)):
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(node.model_fields), n=1, cutoff=0.6)
    return f" (did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))!r}?)" if close else ""


def _problems(found: list[tuple[tuple[str, ...], str]], overrides: Sequence[str], path: str) -> list[Problem]:
    return [Problem(keys[0], msg, _source([k for k in keys if k], overrides, path)) for keys, msg in found]


def validate(data: dict, source: str = "<recipe>", overrides: Sequence[str] = ()) -> Recipe:
    """`data` (the file with `overrides` applied) -> Recipe, or one RecipeError listing every problem."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in _one_per_union(e.errors()):
            for keys, msg in _describe(err, Recipe):
                # a missing key is the file's: --set cannot remove one
                where = source if err["type"] == "missing" else _source(keys, overrides, source)
                problems.append(Problem(keys[0], msg, where))
        raise RecipeError(problems=problems) from None


_UNION_MEMBER = {str: "str", int: "int", float: "float", bool: "bool", list: "list[str]"}


def _one_per_union(errors: list[dict]) -> list[dict]:
    """An extra_args value fails every member of ExtraValue: keep the one error of the member its type
    is meant for (a float's "finite number", a list's bad item), with the member's name out of the key."""
    out, seen = [], {}
    for err in errors:
        loc = err["loc"]
        if not (len(loc) >= 3 and loc[0] == "extra_args"):
            out.append(err)
            continue
        value = err["input"] if len(loc) == 3 else None
        best = seen.get(loc[:2])
        if best is None:
            seen[loc[:2]] = len(out)
            out.append({**err, "loc": loc[:2] + loc[3:]} if len(loc) > 3 or type(value) in _UNION_MEMBER else
                       {**err, "loc": loc[:2], "msg": "a flag value must be a string, number, boolean or list of strings"})
        elif loc[2] == _UNION_MEMBER.get(type(value)) or (loc[2] == "list[str]" and len(loc) > 3):
            out[best] = {**err, "loc": loc[:2] + loc[3:]}
    return out


Check = Callable[["Recipe"], list[tuple[tuple[str, ...], str]]]


def load(path: str | Path, overrides: Sequence[str] = (), checks: Sequence[Check] = ()) -> Recipe:
    """Read, override, validate. `checks` are further whole-recipe checks (e.g. rendering's) whose problems
    are reported like the recipe's own: [(the dotted keys involved, message)]."""
    path = Path(path)
    overrides = list(overrides)

    def fail(message: str) -> RecipeError:
        return RecipeError(problems=[Problem(None, message, str(path))])

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail("recipe file not found (see recipes/ for examples)") from None
    except OSError as e:
        raise fail(f"cannot read the recipe ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise fail(f"TOML syntax error: {e}") from None
    except RecursionError:
        raise fail("TOML syntax error: arrays or inline tables nested too deeply") from None
    found = _check_values(data)  # checked before apply_overrides copies (recursively) the data
    if found:
        raise RecipeError(problems=[Problem(k, m, str(path)) for k, m in found])
    data = apply_overrides(data, overrides)
    found = _check_values(data)
    if found:
        raise RecipeError(problems=_problems([((k,), m) for k, m in found], overrides, str(path)))
    _resolve_paths(data, path.absolute().parent)  # not resolve(): recipes/demo-cpu.toml is a symlink
    recipe = validate(data, str(path), overrides)
    found = [f for check in (expert_problems, *checks) for f in check(recipe)]
    if found:
        raise RecipeError(problems=_problems(found, overrides, str(path)))
    return recipe


def expert_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    experts = expert_count(recipe)
    if experts is not None and experts % recipe.parallel.expert:
        return [(("parallel.expert", "model.path", "model.num_experts"),
                 f"{recipe.parallel.expert} does not divide the model's {experts} experts; "
                 f"choose a divisor of {experts}")]
    return []


def read_model_config(recipe: Recipe) -> dict | None:
    try:
        cfg = json.loads((Path(recipe.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def expert_count(recipe: Recipe) -> int | None:
    if recipe.model.num_experts:
        return recipe.model.num_experts
    cfg = read_model_config(recipe) or {}
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if isinstance(c.get(key), int):
                return c[key]
    return None


# --- the recipe hash -----------------------------------------------------------------------------

# The keys that change the training math. Operational keys (save/logging intervals, paths,
# supervisor, gpu, metrics, env, memory placement) are left out: changing them must not force a
# fresh run. Documented in README.md ("Recipe hash").
HASHED_KEYS: dict[str, tuple[str, ...]] = {
    "run": ("backend",),
    "model": ("path", "model_type", "template", "torch_dtype"),
    "data": ("dataset", "val_dataset", "max_length", "packing", "split_dataset_ratio"),
    "parallel": ("nproc_per_node", "tensor", "pipeline", "context", "expert", "expert_tensor",
                 "sequence_parallel"),
    "lora": ("rank", "alpha", "dropout", "target_modules", "target_parameters"),
    "optim": ("lr", "min_lr", "warmup_fraction", "micro_batch_size", "global_batch_size", "epochs",
              "iterations", "seed"),
}
# extra_args go into the hash unless they are operational.
_OPERATIONAL_EXTRA = re.compile(r"^(report_to|logging_.*|save_.*|eval_steps|eval_iters|tensorboard_.*|wandb_.*|"
                                r"swanlab_.*|dataloader_.*|dataset_num_proc|ddp_timeout|disable_tqdm|"
                                r"create_checkpoint_symlink|async_save|.*_dir)$")


def semantic_view(recipe: Recipe) -> dict:
    view = {sec: {k: getattr(getattr(recipe, sec), k) for k in keys} for sec, keys in HASHED_KEYS.items()}
    view["extra_args"] = {k: v for k, v in recipe.extra_args.items() if not _OPERATIONAL_EXTRA.match(k)}
    return view


def recipe_hash(recipe: Recipe) -> str:
    canonical = json.dumps(semantic_view(recipe), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def changed_keys(old: dict, new: dict) -> list[str]:
    """Dotted keys whose values differ between two semantic views (for drift messages)."""
    out = []
    for sec in sorted(set(old) | set(new)):
        a, b = old.get(sec, {}), new.get(sec, {})
        out += [f"{sec}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out
