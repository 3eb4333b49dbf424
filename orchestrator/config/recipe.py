"""Recipe: one TOML file validated into typed, frozen models (schema.py); `--set` overrides; the recipe hash.

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
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.config.schema import (CheckpointSection, DataSection, EnvSection, ExtraValue, GpuSection,
                                        HealthSection, LoraSection, MemorySection, MetricsSection, ModelSection, OptimSection,
                                        ParallelSection, Recipe, RunSection, SupervisorSection, _Combinations,
                                        combination_problems)

# The schema's names stay importable from here: most callers load a recipe and use its types.
__all__ = [
    "CheckpointSection", "DataSection", "EnvSection", "ExtraValue", "GpuSection", "HealthSection", "LoraSection", "MemorySection",
    "MetricsSection", "ModelSection", "OptimSection", "ParallelSection", "Recipe", "RunSection", "SupervisorSection",
    "combination_problems",
    "Problem", "RecipeError", "Check", "parse_override", "apply_overrides", "validate", "load", "expert_problems",
    "read_model_config", "expert_count", "HASHED_KEYS", "semantic_view", "recipe_hash", "changed_keys",
]


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


# --- loading -------------------------------------------------------------------------------------

# extra_args.mcore_model too: ms-swift would read a relative one against the launch directory (the run's
# output_dir), while model.path, which names the same model, is read against the recipe
_PATH_KEYS = (("run", "output_dir"), ("run", "persistent_dir"), ("model", "path"), ("extra_args", "mcore_model"))


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
    ds: dict = data["data"] if isinstance(data.get("data"), dict) else {}
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


def _one_per_union(errors: Sequence[Any]) -> list[dict]:
    """An extra_args value fails every member of ExtraValue: keep the one error of the member its type
    is meant for (a float's "finite number", a list's bad item), with the member's name out of the key."""
    out: list[dict] = []
    seen: dict = {}
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
    problems = [f for check in (expert_problems, *checks) for f in check(recipe)]
    if problems:
        raise RecipeError(problems=_problems(problems, overrides, str(path)))
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
# supervisor, gpu, metrics, health, env, memory placement) are left out: changing them must not force a
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
