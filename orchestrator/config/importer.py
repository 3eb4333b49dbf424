"""`orchestrator import`'s translation: a training command (command_form.Training) -> recipe data, and a report
of what happened to every flag and variable: mapped to its recipe key, renamed from its 3.x (or other
backend's) name to the 4.x one and mapped, or dropped with the reason. Pure: uses the argument tables the
project ships (flags.KNOWN, flags.MANAGED, flags.RENAMED) and the recipe schema's field types.
"""
from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field

from orchestrator.config import flags as F
from orchestrator.config.command_form import Flag, ImportRefused, Training
from orchestrator.config.import_env import default_processes, environment
from orchestrator.config.import_values import convert, extra_value
from orchestrator.config.launch_wrappers import why_dropped
from orchestrator.config.schema import Recipe

# Flags rendered from a recipe key (beyond flags.MANAGED's): flag -> dotted key.
_MORE_KEYS = {
    "megatron": {"model_type": "model.model_type", "torch_dtype": "model.torch_dtype",
                 "context_parallel_size": "parallel.context", "save_safetensors": "checkpoint.save_safetensors",
                 "async_save": "checkpoint.async_save"},
    "swift": {"model_type": "model.model_type", "enable_jit_checkpoint": "checkpoint.save_on_stop"},
}
_BOTH_KEYS = {"val_dataset": "data.val_dataset", "split_dataset_ratio": "data.split_dataset_ratio",
              "dataset_num_proc": "data.dataset_num_proc", "dataloader_num_workers": "data.dataloader_num_workers",
              "seed": "optim.seed", "save_total_limit": "checkpoint.save_total_limit", "ddp_timeout": "parallel.ddp_timeout_s"}
# Flags whose value the orchestrator always renders the same: carried when the command agrees.
_CONSTANT = {"tuner_type": "lora", "add_version": "false", "check_model": "false", "load_from_cache_file": "true",
             "finetune": "true"}
_CONSTANT_WHY = {
    "add_version": "the orchestrator always renders --add_version false: checkpoints stay directly in output_dir, "
                   "where it verifies and resumes them",
    "check_model": "the orchestrator always renders --check_model false: no hub call at launch (runs are offline)",
    "load_from_cache_file": "the orchestrator always renders --load_from_cache_file true: a relaunch reuses the "
                            "preprocessed dataset",
    "finetune": "resume is the orchestrator's: it renders --finetune true on the first launch and --mcore_adapter "
                "<newest verified checkpoint> --finetune false on a relaunch",
}
_RESUME = {"mcore_adapter", "adapters", "resume_from_checkpoint", "resume_only_model"}
_RESUME_WHY = ("resume is the orchestrator's: each relaunch resumes from the newest verified checkpoint (it adds "
               "this flag itself); starting from an existing adapter is not imported")
_SAVE_STEPS_WHY = ('the orchestrator chooses the interval at every launch (checkpoint.save_steps = "auto": the '
                   'measured save cost and crash rate); set checkpoint.save_steps = {v} to keep a fixed one')
_PATH_FLAGS = {"model", "output_dir", "dataset", "val_dataset"}


def recipe_keys(backend: str) -> dict[str, str]:
    """flag -> the dotted recipe key it is rendered from, for `backend`."""
    managed = {k: v for k, v in F.MANAGED[backend].items() if not v.startswith("(")}
    for special in ("save_steps", "no_save_optim", "save_only_model", "merge_lora"):
        managed.pop(special, None)
    return managed | _MORE_KEYS[backend] | _BOTH_KEYS


@dataclass
class Imported:
    """The recipe data and the report: `mapped` [{flag, value, key}], `renamed` [{flag, to, value, key}],
    `dropped` [{flag, value, reason}], `notes` what the recipe adds that the command did not say."""

    recipe: dict
    mapped: list[dict] = field(default_factory=list)
    renamed: list[dict] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def drop(self, flag: str, value: str, reason: str) -> None:
        self.dropped.append({"flag": flag, "value": value, "reason": reason})

    def set(self, key: str, value: object) -> None:
        section, _, name = key.rpartition(".")
        node = self.recipe
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = value


def _field_type(key: str) -> type:
    """The Python type a recipe key holds (list, bool, int, float or str)."""
    section, name = key.split(".", 1)
    ann: typing.Any = Recipe.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]
    args = [a for a in typing.get_args(ann) if a is not type(None)] if isinstance(ann, types.UnionType) or \
        typing.get_origin(ann) is typing.Union else [ann]
    base = args[0]
    origin = typing.get_origin(base)
    if origin is list:
        return list
    if origin is typing.Literal:
        return str
    return base if base in (bool, int, float) else str


def _latest(flag_list: tuple[Flag, ...], out: Imported, backend: str) -> list[tuple[Flag, str]]:
    """(flag, its 4.x name) for each flag, renames applied; a flag given twice: argparse takes the last one."""
    named = [(f, F.RENAMED[backend].get(f.name, f.name)) for f in flag_list]
    last = {name: i for i, (_, name) in enumerate(named)}
    kept = []
    for i, (f, name) in enumerate(named):
        if last[name] != i:
            out.drop(f.written, " ".join(f.values), f"--{name} is given again later (line {named[last[name]][0].line}); "
                                                     "ms-swift takes the last one")
        else:
            kept.append((f, name))
    return kept


def _switch(f: Flag) -> bool:
    """Reads a true/false flag; ImportRefused naming its line when the value is neither."""
    try:
        return convert(f.values, bool) is True
    except ValueError as e:
        raise ImportRefused([f"line {f.line}: {f.written}: {e}"]) from None


def translate(t: Training, run_name: str) -> Imported:
    """The recipe data and the report for the training command `t`; ImportRefused for a command this tool
    does not supervise (not LoRA) or values it cannot read."""
    backend = t.backend
    use_megatron = [f for f in t.flags if f.name == "use_megatron"]
    if t.form == "swift sft" and use_megatron and _switch(use_megatron[-1]):
        backend = "megatron"  # `swift sft --use_megatron true`: what the author meant is `megatron sft`
    out = Imported({"run": {"name": run_name, "backend": backend}}, notes=list(t.notes))
    problems: list[str] = []
    keys = recipe_keys(backend)
    given: dict[str, tuple[Flag, str]] = {}
    for f, name in _latest(t.flags, out, backend):
        value = " ".join(f.values)
        if name in ("use_megatron",):
            out.drop(f.written, value, 'not an ms-swift 4.x flag: Megatron training is the `megatron sft` command '
                                       f'(run.backend = "{backend}")')
            continue
        problem = None if (backend, name) == ("megatron", "gradient_accumulation_steps") else F.check_flag(backend, name)
        if problem is not None:
            cut = f is t.flags[-1] and not f.values and any(k.startswith(name) for k in F.KNOWN[backend])
            if cut:
                problems.append(f"line {f.line}: the command ends in `{f.written}`: it looks cut off mid-flag")
            out.drop(f.written, value, problem)
            continue
        given[name] = (f, name)
    if problems:
        raise ImportRefused(problems)
    _tuner(backend, given, t.line)
    for name, (f, _) in given.items():
        try:
            _one(out, backend, keys, f, name, given)
        except ValueError as e:
            cut = f is t.flags[-1] and not f.values
            problems.append(f"line {f.line}: {f.written}: {e}" + (" (the command looks cut off)" if cut else ""))
    if problems:
        raise ImportRefused(problems)
    environment(out, t)
    for item in t.launch:
        out.drop(item, "", why_dropped(item))
    _defaults(out, t, backend, given, problems)
    if problems:
        raise ImportRefused(problems)
    return out


def _tuner(backend: str, given: dict[str, tuple[Flag, str]], line: int) -> None:
    """ImportRefused unless the command is a LoRA fine-tune (megatron sft's default --tuner_type is full)."""
    if "tuner_type" in given:
        f, _ = given["tuner_type"]
        kind = " ".join(f.values)
        if kind != "lora":
            what = "full-parameter training" if kind == "full" else f"--tuner_type {kind}"
            raise ImportRefused([(f"line {f.line}: {f.written} {kind}: {what} is not supervised by this tool: it "
                                 "supervises LoRA fine-tunes (--tuner_type lora)")])
    elif backend == "megatron" and not ({"adapters", "mcore_adapter"} & given.keys()):
        raise ImportRefused([(f"line {line}: no --tuner_type: `megatron sft` then trains all parameters (its default --tuner_type "
                             "is full), which this tool does not supervise; add --tuner_type lora for a LoRA run")])


def _record(out: Imported, f: Flag, name: str, key: str) -> None:
    value = " ".join(f.values)
    if f.name != name:
        out.renamed.append({"flag": f.written, "to": f"--{name}", "value": value, "key": key})
    else:
        out.mapped.append({"flag": f.written, "value": value, "key": key})


def _one(out: Imported, backend: str, keys: dict[str, str], f: Flag, name: str, given: dict) -> None:
    """One flag into the recipe (or the report's dropped list)."""
    value = " ".join(f.values)
    if name == "save_steps":
        out.drop(f.written, value, _SAVE_STEPS_WHY.format(v=value or "N"))
    elif name in _RESUME or (name == "finetune" and convert(f.values, bool) is False):
        out.drop(f.written, value, _RESUME_WHY)
    elif name in _CONSTANT:
        wanted = _CONSTANT[name]
        if name == "tuner_type" or str(convert(f.values, bool)).lower() == wanted:
            _record(out, f, name, F.ALWAYS.strip("()") if name != "finetune" else F.ON_RESUME.strip("()"))
        else:
            out.drop(f.written, value, _CONSTANT_WHY[name])
    elif name == "save_total_limit" and convert(f.values, int) <= 0:  # type: ignore[operator]
        out.drop(f.written, value, "no limit (ms-swift keeps every checkpoint): the orchestrator prunes them itself "
                                   "(checkpoint.keep_local, checkpoint.keep_persistent)")
    elif name in ("no_save_optim", "no_save_rng", "save_only_model"):
        keep = not convert(f.values, bool)
        partner = {"no_save_optim": "no_save_rng", "no_save_rng": "no_save_optim"}.get(name)
        if partner in given and (not convert(given[partner][0].values, bool)) != keep and name == "no_save_rng":
            out.drop(f.written, value, "checkpoint.keep_optimizer renders --no_save_optim and --no_save_rng "
                                       "together; the recipe follows --no_save_optim")
            return
        out.set("checkpoint.keep_optimizer", keep)
        _record(out, f, name, "checkpoint.keep_optimizer")
    elif name == "merge_lora":
        out.set("checkpoint.merge", "every_save" if convert(f.values, bool) else "never")
        _record(out, f, name, "checkpoint.merge")
    elif name == "gradient_accumulation_steps":
        out.set("optim.gradient_accumulation_steps", convert(f.values, int))  # folded in by _defaults
        _record(out, f, name, "optim.global_batch_size")
    elif name in keys:
        out.set(keys[name], convert(f.values, _field_type(keys[name])))
        _record(out, f, name, keys[name])
    else:
        out.recipe.setdefault("extra_args", {})[name] = extra_value(f.values)
        _record(out, f, name, f"extra_args.{name}")


def _get(out: Imported, key: str) -> typing.Any:
    section, name = key.split(".")
    return out.recipe.get(section, {}).get(name)


def _defaults(out: Imported, t: Training, backend: str, given: dict, problems: list[str]) -> None:
    """What the recipe needs and the command left to ms-swift's defaults; exclusive flags settled as ms-swift does."""
    mcore = out.recipe.get("extra_args", {}).get("mcore_model")
    if _get(out, "model.path") is None and isinstance(mcore, str):
        # 3.x `--load DIR` alone (3.x found the model via DIR/args.json): the directory stands in; pre-flight checks it
        out.set("model.path", mcore)
        out.notes.append(f"model.path = {mcore!r}: the --mcore_model (3.x --load) checkpoint, as the command gave no "
                         "--model; ms-swift 4 reads the weights from --mcore_model but the config and tokenizer from "
                         "--model: set model.path to the HF model directory (the one the checkpoint's args.json names "
                         "under \"model\") unless that checkpoint holds config.json; `orchestrator plan` checks")
    for key, flag in (("model.path", "--model"), ("data.dataset", "--dataset")):
        if _get(out, key) is None:
            problems.append(f"line {t.line}: no {flag}: the recipe needs {key}")
    out.set("checkpoint.save_steps", "auto")  # the command's --save_steps is in the report's dropped list
    if _get(out, "optim.lr") is None:
        out.set("optim.lr", 1e-4)
        out.notes.append("optim.lr = 1e-4: ms-swift's default learning rate for LoRA (the command gave none)")
    if _get(out, "run.output_dir") is None:
        d = "megatron_output" if backend == "megatron" else "output"
        out.set("run.output_dir", d)
        out.notes.append(f"run.output_dir = {d!r}: ms-swift's default (the command gave none); relative to the recipe")
    epochs, iterations = _get(out, "optim.epochs"), _get(out, "optim.iterations")
    if epochs is not None and iterations is not None:
        # megatron sft: epochs win for a non-streaming dataset; swift sft (transformers): max_steps wins
        loser = "optim.iterations" if backend == "megatron" else "optim.epochs"
        flag = {"optim.iterations": "train_iters" if backend == "megatron" else "max_steps",
                "optim.epochs": "num_train_epochs"}[loser]
        f, _ = given[flag]
        out.recipe["optim"].pop(loser.split(".")[1])
        for lst in (out.mapped, out.renamed):
            lst[:] = [e for e in lst if e["key"] != loser]
        out.drop(f.written, " ".join(f.values), f"given with {'--num_train_epochs' if loser != 'optim.epochs' else '--max_steps'}, "
                                                 f"which ms-swift's `{F.COMMAND[backend]}` follows instead")
    elif epochs is None and iterations is None:
        if backend == "megatron":
            problems.append(f"line {t.line}: neither --num_train_epochs nor --train_iters: `megatron sft` cannot "
                            "tell when to stop")
        else:
            out.set("optim.epochs", 3.0)
            out.notes.append("optim.epochs = 3: ms-swift's default --num_train_epochs (the command gave none)")
    default_processes(out, t, backend)
    par = out.recipe["parallel"]
    if par.get("sequence_parallel") and par.get("tensor", 1) <= 1:
        par.pop("sequence_parallel")
        f, _ = given["sequence_parallel"]
        out.mapped[:] = [e for e in out.mapped if e["key"] != "parallel.sequence_parallel"]
        out.drop(f.written, " ".join(f.values), "a no-op at tensor parallel 1: ms-swift turns sequence parallelism "
                                                "off when tensor_model_parallel_size <= 1")
    mem = out.recipe.get("memory", {})
    if "optimizer_offload_fraction" in mem and not mem.get("optimizer_cpu_offload"):
        mem.pop("optimizer_offload_fraction")  # rendered only with the offload on, as Megatron reads it only then
        f, _ = given["optimizer_offload_fraction"]
        for entries in (out.mapped, out.renamed):
            entries[:] = [e for e in entries if e["key"] != "memory.optimizer_offload_fraction"]
        out.drop(f.written, " ".join(f.values), "a no-op without --optimizer_cpu_offload true (Megatron offloads "
                                                "only then): set memory.optimizer_cpu_offload = true to offload")
    _batch(out, backend)
    model = _get(out, "model.path")
    if isinstance(model, str) and not model.startswith("/"):
        out.notes.append(f"model.path {model!r} is relative: read against the recipe's directory. A hub id is not "
                         "downloaded (runs are offline, HF_HUB_OFFLINE=1): download it first and set model.path to "
                         "the local directory")
    if _get(out, "model.torch_dtype") is None:
        out.notes.append("model.torch_dtype = bfloat16: the recipe's default (the command gave none; ms-swift would "
                         "take the model's own dtype)")
    if _get(out, "data.dataloader_num_workers") is None:
        out.notes.append("data.dataloader_num_workers = 0: the recipe's default (the command gave none; ms-swift's "
                         f"is {'4' if backend == 'megatron' else 'its own choice'})")
    if _get(out, "data.max_length") is None:
        out.notes.append("data.max_length = 2048: the recipe's default (the command gave none; ms-swift would "
                         "take the model's maximum)")


def _batch(out: Imported, backend: str) -> None:
    """swift sft: optim.global_batch_size from the micro batch, the accumulation and the data-parallel size."""
    optim = out.recipe.setdefault("optim", {})
    accumulation = optim.pop("gradient_accumulation_steps", None)
    par = out.recipe.get("parallel", {})
    world = par.get("nproc_per_node", 1) * par.get("nnodes", 1)
    micro = optim.get("micro_batch_size", 1)
    if backend != "swift":  # megatron sft has no --gradient_accumulation_steps: the global batch says it
        if accumulation is not None:
            flag = next(e for e in out.mapped + out.renamed if e["key"] == "optim.global_batch_size"
                        and "gradient_accumulation_steps" in e["flag"])
            for entries in (out.mapped, out.renamed):
                if flag in entries:
                    entries.remove(flag)
            dp = world // (par.get("tensor", 1) * par.get("pipeline", 1) * par.get("context", 1) or 1)
            if "global_batch_size" in optim:
                why = f"--global_batch_size {optim['global_batch_size']} is given and decides the accumulation"
            else:
                optim["global_batch_size"] = micro * accumulation * dp
                why = (f"`megatron sft` has no such flag: optim.global_batch_size = micro batch x accumulation x "
                       f"data-parallel size = {micro} x {accumulation} x {dp} = {optim['global_batch_size']}")
            out.drop(flag["flag"], flag["value"], why)
        return
    if accumulation is None:  # ms-swift's own default (TrainArguments: 16 samples per step)
        accumulation = max(1, math.ceil(16 / micro / world))
        out.notes.append(f"gradient accumulation {accumulation}: ms-swift's default for this batch and world size "
                         f"(optim.global_batch_size = {micro * accumulation * world})")
    optim["global_batch_size"] = micro * accumulation * world
