"""ms-swift 4.x flag names for `megatron sft` / `swift sft`, and the checks recipes go through.

ms-swift parses argv with transformers' HfArgumentParser over one dataclass per command; a flag it
does not know is fatal (`ValueError: remaining_argv`), a bare 3.x `--save` is an ambiguous argparse
prefix (exit 2), and an unambiguous prefix is silently taken as the full flag. The orchestrator is
stricter: a flag must be spelled exactly as a field of the 4.x dataclass.

`data/swift_flags.json` is generated from the installed ms-swift by `scripts/extract_swift_flags.py`.
Pure and stdlib-only.
"""
from __future__ import annotations

import difflib
import json
from importlib.resources import files

BACKENDS = ("megatron", "swift")
COMMAND = {"megatron": "megatron sft", "swift": "swift sft"}

_DATA = json.loads(files("orchestrator").joinpath("data", "swift_flags.json").read_text(encoding="utf-8"))
MS_SWIFT_VERSION: str = _DATA["ms_swift_version"]
KNOWN: dict[str, frozenset[str]] = {b: frozenset(_DATA[b]) for b in BACKENDS}

ON_RESUME = "(set by orchestrator on resume)"
ALWAYS = "(always set by orchestrator)"

# flag -> the recipe dotted key it is rendered from (or why the orchestrator owns it)
MANAGED: dict[str, dict[str, str]] = {
    "megatron": {
        "expert_model_parallel_size": "parallel.expert",
        "tensor_model_parallel_size": "parallel.tensor",
        "pipeline_model_parallel_size": "parallel.pipeline",
        "expert_tensor_parallel_size": "parallel.expert_tensor",
        "sequence_parallel": "parallel.sequence_parallel",
        "recompute_granularity": "memory.recompute_granularity",
        "recompute_method": "memory.recompute_method",
        "recompute_num_layers": "memory.recompute_num_layers",
        "optimizer_cpu_offload": "memory.optimizer_cpu_offload",
        "optimizer_offload_fraction": "memory.optimizer_offload_fraction",
        "use_precision_aware_optimizer": "memory.precision_aware_optimizer",
        "lora_rank": "lora.rank",
        "lora_alpha": "lora.alpha",
        "lora_dropout": "lora.dropout",
        "target_modules": "lora.target_modules",
        "lr": "optim.lr",
        "min_lr": "optim.min_lr",
        "lr_warmup_fraction": "optim.warmup_fraction",
        "micro_batch_size": "optim.micro_batch_size",
        "global_batch_size": "optim.global_batch_size",
        "num_train_epochs": "optim.epochs",
        "train_iters": "optim.iterations",
        "save_steps": "checkpoint.save_steps",
        "no_save_optim": "checkpoint.keep_optimizer",
        "merge_lora": "checkpoint.merge",
        "logging_steps": "checkpoint.logging_steps",
        "model": "model.path",
        "dataset": "data.dataset",
        "max_length": "data.max_length",
        "packing": "data.packing",
        "output_dir": "run.output_dir",
        "mcore_adapter": ON_RESUME,
        "adapters": ON_RESUME,
        "finetune": ON_RESUME,
        "add_version": ALWAYS,
        "check_model": ALWAYS,
        "tuner_type": ALWAYS,
    },
    "swift": {
        "lora_rank": "lora.rank",
        "lora_alpha": "lora.alpha",
        "lora_dropout": "lora.dropout",
        "target_modules": "lora.target_modules",
        "target_parameters": "lora.target_parameters",
        "learning_rate": "optim.lr",
        "warmup_ratio": "optim.warmup_fraction",
        "per_device_train_batch_size": "optim.micro_batch_size",
        "gradient_accumulation_steps": "(derived from optim.global_batch_size)",
        "num_train_epochs": "optim.epochs",
        "max_steps": "optim.iterations",
        "save_steps": "checkpoint.save_steps",
        "save_only_model": "checkpoint.keep_optimizer",
        "logging_steps": "checkpoint.logging_steps",
        "model": "model.path",
        "template": "model.template",
        "torch_dtype": "model.torch_dtype",
        "dataset": "data.dataset",
        "max_length": "data.max_length",
        "packing": "data.packing",
        "output_dir": "run.output_dir",
        "resume_from_checkpoint": ON_RESUME,
        "add_version": ALWAYS,
        "check_model": ALWAYS,
        "tuner_type": ALWAYS,
    },
}

_NO_MCORE = 'does not exist: Megatron training is selected by the `megatron sft` command (run.backend = "megatron")'
_SWIFT_MEGATRON_ONLY = 'a `megatron sft` flag; use run.backend = "megatron"'
_RENAMED = "renamed in ms-swift 4.0"


def _to(backend: str, flag: str, note: str = "") -> str:
    """Hint naming the 4.x flag, plus the recipe key that renders it when the orchestrator does."""
    notes = [note] if note else []
    key = MANAGED[backend].get(flag)
    if key:
        notes.append(key.strip("()") if key.startswith("(") else f"recipe key {key}")
    return f"{flag} ({'; '.join(notes)})" if notes else flag


# old / fictional / other-backend name -> one-line hint naming the 4.x replacement
REPLACEMENTS: dict[str, dict[str, str]] = {
    "megatron": {
        "save_interval": _to("megatron", "save_steps", _RENAMED),
        "save": _to("megatron", "output_dir", f"{_RENAMED}; a bare --save is an ambiguous prefix, exit 2"),
        "load": _to("megatron", "mcore_model", _RENAMED),
        "adapter_load": _to("megatron", "mcore_adapter", _RENAMED),
        "eval_interval": _to("megatron", "eval_steps", _RENAMED),
        "log_interval": _to("megatron", "logging_steps", _RENAMED),
        "max_epochs": _to("megatron", "num_train_epochs", _RENAMED),
        "num_workers": _to("megatron", "dataloader_num_workers", _RENAMED),
        "train_type": _to("megatron", "tuner_type", "renamed in ms-swift 4.0, alias dropped in 4.1"),
        "manual_gc_interval": _to("megatron", "manual_gc_steps", _RENAMED),
        "load_safetensors": "removed in 4.x (weights load from --model via mcore-bridge)",
        "learning_rate": _to("megatron", "lr", "megatron sft rejects --learning_rate"),
        "resume_from_checkpoint": "mcore_adapter <ckpt> + finetune false (orchestrator adds these when it resumes)",
        "use_megatron": _NO_MCORE,
        "megatron_use_mcore": _NO_MCORE,
        "use_mcore": _NO_MCORE,
        "max_steps": _to("megatron", "train_iters", "swift sft name"),
        "per_device_train_batch_size": _to("megatron", "micro_batch_size", "swift sft name"),
        "gradient_accumulation_steps": "derived: global_batch_size / (micro_batch_size x data-parallel size);"
                                       " recipe key optim.global_batch_size",
        "warmup_ratio": _to("megatron", "lr_warmup_fraction", "swift sft name"),
        "warmup_steps": _to("megatron", "lr_warmup_iters", "swift sft name"),
        "lr_scheduler_type": _to("megatron", "lr_decay_style", "swift sft name"),
        "max_grad_norm": _to("megatron", "clip_grad", "swift sft name"),
        "adam_epsilon": _to("megatron", "adam_eps", "swift sft name"),
        "gradient_checkpointing": _to("megatron", "recompute_granularity", "swift sft name"),
        "save_only_model": _to("megatron", "no_save_optim", "swift sft name; also no_save_rng"),
        "resume_only_model": "adapters <ckpt> + finetune false (weights-only resume; swift sft name)",
        "deepspeed": "swift sft only; megatron sft shards with tensor/pipeline/expert parallel sizes (parallel.*)",
        "fsdp": "swift sft only; Megatron-FSDP is use_megatron_fsdp",
        "target_parameters": "swift sft only; megatron LoRA targets are target_modules / target_regex",
        "use_flash_attn": _to("megatron", "attention_backend", "3.x's Megatron-LM switch; 4.x's default is flash"),
        "no_rope_fusion": "apply_rope_fusion, with the opposite value (3.x name)",
        "no_bias_swiglu_fusion": "bias_activation_fusion, with the opposite value (3.x name)",
    },
    "swift": {
        "train_type": _to("swift", "tuner_type", "renamed in ms-swift 4.0, alias dropped in 4.1"),
        "lr": _to("swift", "learning_rate", "`lr` is the megatron sft name"),
        "evaluation_strategy": _to("swift", "eval_strategy", "the transformers name before 4.46"),
        "use_megatron": 'does not exist: use run.backend = "megatron" (the `megatron sft` command)',
        "megatron_use_mcore": 'does not exist: use run.backend = "megatron" (the `megatron sft` command)',
        "use_mcore": 'does not exist: use run.backend = "megatron" (the `megatron sft` command)',
        "train_iters": _to("swift", "max_steps", "megatron sft name"),
        "micro_batch_size": _to("swift", "per_device_train_batch_size", "megatron sft name"),
        "global_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x world size;"
                             " recipe key optim.global_batch_size",
        "lr_warmup_fraction": _to("swift", "warmup_ratio", "megatron sft name"),
        "lr_warmup_iters": _to("swift", "warmup_steps", "megatron sft name"),
        "min_lr": "lr_scheduler_type cosine_with_min_lr + lr_scheduler_kwargs '{\"min_lr\": ...}'",
        "lr_decay_style": _to("swift", "lr_scheduler_type", "megatron sft name"),
        "clip_grad": _to("swift", "max_grad_norm", "megatron sft name"),
        "adam_eps": _to("swift", "adam_epsilon", "megatron sft name"),
        "save_interval": _to("swift", "save_steps", "3.x megatron name"),
        "save": _to("swift", "output_dir", "3.x megatron name; a bare --save is an ambiguous prefix, exit 2"),
        "load": _to("swift", "resume_from_checkpoint", "3.x megatron --load"),
        "adapter_load": _to("swift", "resume_from_checkpoint", "3.x megatron --adapter_load"),
        "mcore_adapter": _to("swift", "resume_from_checkpoint", "mcore_adapter is megatron sft only"),
        "mcore_model": _to("swift", "resume_from_checkpoint", "mcore_model is megatron sft only"),
        "finetune": _to("swift", "resume_from_checkpoint", "finetune is megatron sft only"),
        "eval_interval": _to("swift", "eval_steps", "3.x megatron name"),
        "log_interval": _to("swift", "logging_steps", "3.x megatron name"),
        "num_workers": _to("swift", "dataloader_num_workers", "3.x megatron name"),
        "load_safetensors": "removed in 4.x",
        "no_save_optim": _to("swift", "save_only_model", "megatron sft name"),
        "merge_lora": "checkpoint.merge = \"final\" (`swift export --adapters <ckpt> --merge_lora true` after training)",
        "recompute_granularity": "gradient_checkpointing (swift sft has no recompute_* flags)",
        "recompute_method": "gradient_checkpointing (swift sft has no recompute_* flags)",
        "recompute_num_layers": "gradient_checkpointing (swift sft has no recompute_* flags)",
        "optimizer_cpu_offload": "megatron sft only; swift sft offloads with deepspeed zero2_offload / zero3_offload",
        "optimizer_offload_fraction": "megatron sft only; swift sft offloads with deepspeed zero3_offload",
        "use_precision_aware_optimizer": _SWIFT_MEGATRON_ONLY,
        **{p: f"{_SWIFT_MEGATRON_ONLY}; swift sft scales with deepspeed / fsdp" for p in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel")},
    },
}


# old / other-backend name -> the 4.x name taking the same value (what `orchestrator import` renames):
# the 3.x -> 4.x renames above, and the other command's name where only the name differs.
RENAMED: dict[str, dict[str, str]] = {
    "megatron": {
        "save_interval": "save_steps", "save": "output_dir", "load": "mcore_model", "adapter_load": "mcore_adapter",
        "eval_interval": "eval_steps", "log_interval": "logging_steps", "max_epochs": "num_train_epochs",
        "num_workers": "dataloader_num_workers", "train_type": "tuner_type", "manual_gc_interval": "manual_gc_steps",
        "learning_rate": "lr", "max_steps": "train_iters", "per_device_train_batch_size": "micro_batch_size",
        "warmup_ratio": "lr_warmup_fraction", "warmup_steps": "lr_warmup_iters", "max_grad_norm": "clip_grad",
        "adam_epsilon": "adam_eps", "save_only_model": "no_save_optim", "lora_target_modules": "target_modules",
        "use_flash_attn": "attention_backend",
    },
    "swift": {
        "train_type": "tuner_type", "lr": "learning_rate", "train_iters": "max_steps",
        "micro_batch_size": "per_device_train_batch_size", "lr_warmup_fraction": "warmup_ratio",
        "lr_warmup_iters": "warmup_steps", "clip_grad": "max_grad_norm", "adam_eps": "adam_epsilon",
        "save_interval": "save_steps", "save": "output_dir", "eval_interval": "eval_steps",
        "log_interval": "logging_steps", "num_workers": "dataloader_num_workers", "no_save_optim": "save_only_model",
        "lora_target_modules": "target_modules", "evaluation_strategy": "eval_strategy",
    },
}
# ms-swift 2.x names still in old scripts (3.x and 4.x reject them: `ValueError: remaining_argv`), each taking the
# same value under its 4.x name
# (legacy.py converts the values whose 2.x spelling 4.x rejects: `--dtype bf16`, `--deepspeed default-zero2`, ...)
_V2 = {"lora_target_modules": "target_modules", "sft_type": "tuner_type", "model_id_or_path": "model",
       "custom_train_dataset_path": "dataset", "custom_val_dataset_path": "val_dataset", "lora_dropout_p": "lora_dropout",
       "dtype": "torch_dtype", "preprocess_num_proc": "dataset_num_proc", "dataset_test_ratio": "split_dataset_ratio",
       "quantization_bit": "quant_bits", "bnb_4bit_comp_dtype": "bnb_4bit_compute_dtype",
       "lora_modules_to_save": "modules_to_save"}
# 2.x names whose 4.x name differs between the two commands (2.x had one `--batch_size` for both)
_V2_BY_BACKEND = {"megatron": {"batch_size": "micro_batch_size",
                               "template_type": "template"},
                  "swift": {"batch_size": "per_device_train_batch_size", "use_flash_attn": "attn_impl",
                            "eval_batch_size": "per_device_eval_batch_size", "template_type": "template"}}
for _b in BACKENDS:
    for _old, _new in (_V2 | _V2_BY_BACKEND[_b]).items():
        REPLACEMENTS[_b][_old] = _to(_b, _new, "the ms-swift 2.x name")
        RENAMED[_b].setdefault(_old, _new)
    # 2.x names with no 4.x flag: what became of them
    REPLACEMENTS[_b] |= {
        "check_dataset_strategy": "removed in ms-swift 3.0 (2.x's dataset check has no 4.x switch)",
        "train_dataset_mix_ratio": "removed in ms-swift 3.0 (mix datasets with `--dataset name#N` counts)",
        "use_loss_scale": "removed in ms-swift 3.0 (the agent loss weighting is `--loss_scale`)",
        "train_dataset_sample": "removed in ms-swift 3.0 (sample with `--dataset name#N`)",
        "val_dataset_sample": "removed in ms-swift 3.0 (sample with `--val_dataset name#N`)",
        "self_cognition_sample": "removed in ms-swift 3.0 (add `swift/self-cognition#N` to --dataset)",
    }


def normalise(name: str) -> str:
    """`--save-steps` / `save-steps` / `save_steps` -> `save_steps`."""
    return name.strip().lstrip("-").replace("-", "_")


def _backend(backend: str) -> str:
    if backend not in KNOWN:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return backend


def check_flag(backend: str, name: str) -> str | None:
    """None if `name` is a `<backend> sft` flag of the pinned ms-swift 4.x; otherwise why not, with a hint."""
    known = KNOWN[_backend(backend)]
    flag = normalise(name)
    if flag in known:
        return None
    head = f"`--{flag}` is not an ms-swift {MS_SWIFT_VERSION} `{COMMAND[backend]}` flag"
    if not flag:
        return f"empty flag name {name!r}"
    hint = REPLACEMENTS[backend].get(flag)
    if hint is not None:
        return f"{head}: {'use ' if hint.split()[0] in known else ''}{hint}"
    if flag.startswith("no_") and flag[3:] in known:
        return f"{head}: give `{flag[3:]}` the value false (HfArgumentParser's --no_X negation is not accepted here)"
    prefixed = sorted(k for k in known if k.startswith(flag))
    if prefixed:
        shown = ", ".join(f"--{k}" for k in prefixed[:4]) + (", ..." if len(prefixed) > 4 else "")
        return f"{head}: it is only an abbreviation of {shown}; spell the flag in full"
    close = difflib.get_close_matches(flag, known, n=3)
    if close:
        return f"{head}; did you mean " + " or ".join(f"`--{c}`" for c in close) + "?"
    return head


def check_extra_arg(backend: str, name: str) -> str | None:
    """check_flag, plus: flags the orchestrator renders itself must come from their recipe key."""
    problem = check_flag(backend, name)
    if problem is not None:
        return problem
    flag = normalise(name)
    owner = MANAGED[backend].get(flag)
    if owner is None:
        return None
    if owner.startswith("("):
        return f"`--{flag}` cannot be given in extra_args {owner}"
    return f"`--{flag}` is rendered from the recipe: set recipe key {owner} instead of extra_args"
