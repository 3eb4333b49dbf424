"""The ms-swift 4.x flag table (orchestrator/data/swift_flags.json) and its checker."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from orchestrator.config import flags
from orchestrator.config.flags import KNOWN, MANAGED, REPLACEMENTS, check_extra_arg, check_flag

ROOT = Path(__file__).resolve().parent.parent
SWIFT_INSTALLED = importlib.util.find_spec("swift") is not None and importlib.util.find_spec("transformers") is not None

# --- the generated table -------------------------------------------------------------------------

MEGATRON_HAS = """expert_model_parallel_size expert_tensor_parallel_size tensor_model_parallel_size
    pipeline_model_parallel_size sequence_parallel context_parallel_size recompute_granularity recompute_method
    recompute_num_layers optimizer_cpu_offload optimizer_offload_fraction use_precision_aware_optimizer mcore_adapter
    mcore_model adapters finetune save_steps no_save_optim no_save_rng no_load_optim merge_lora save_safetensors
    add_version check_model lr min_lr lr_warmup_fraction train_iters num_train_epochs micro_batch_size
    global_batch_size packing max_length dataset tuner_type lora_rank lora_alpha lora_dropout target_modules
    logging_steps eval_steps ddp_timeout output_dir model manual_gc_steps dataloader_num_workers
    create_checkpoint_symlink use_megatron_fsdp template torch_dtype""".split()
MEGATRON_LACKS = """save_interval learning_rate resume_from_checkpoint use_megatron megatron_use_mcore use_mcore
    train_type save load adapter_load log_interval eval_interval max_epochs num_workers manual_gc_interval
    load_safetensors max_steps per_device_train_batch_size gradient_accumulation_steps warmup_ratio
    _teacher_use_disable_adapter""".split()
SWIFT_HAS = """learning_rate resume_from_checkpoint max_steps per_device_train_batch_size gradient_accumulation_steps
    target_parameters enable_jit_checkpoint tuner_type template torch_dtype warmup_ratio save_only_model
    num_train_epochs save_steps logging_steps output_dir model dataset max_length packing lora_rank lora_alpha
    target_modules add_version check_model deepspeed max_epochs""".split()
SWIFT_LACKS = """lr train_iters micro_batch_size global_batch_size use_megatron megatron_use_mcore use_mcore train_type
    mcore_adapter mcore_model finetune merge_lora tensor_model_parallel_size expert_model_parallel_size
    recompute_granularity optimizer_cpu_offload save_interval""".split()


@pytest.mark.parametrize("backend,name", [("megatron", n) for n in MEGATRON_HAS] + [("swift", n) for n in SWIFT_HAS])
def test_table_has(backend, name):
    assert name in KNOWN[backend]


@pytest.mark.parametrize("backend,name",
                         [("megatron", n) for n in MEGATRON_LACKS] + [("swift", n) for n in SWIFT_LACKS])
def test_table_lacks(backend, name):
    assert name not in KNOWN[backend]


def test_table_shape():
    data = json.loads(files("orchestrator").joinpath("data", "swift_flags.json").read_text(encoding="utf-8"))
    assert data["ms_swift_version"] == flags.MS_SWIFT_VERSION == "4.6.0"
    assert data["transformers_version"]
    for backend in flags.BACKENDS:
        names = data[backend]
        assert names == sorted(set(names)), "sorted, no duplicates"
        assert len(names) > 300
        assert all(re.fullmatch(r"[a-z][A-Za-z0-9_]*", n) for n in names), "no private or odd names"


# --- check_flag ----------------------------------------------------------------------------------

# (backend, name as written, fragments the message must contain)
REJECTED = [
    # 3.x -> 4.x Megatron renames
    ("megatron", "save_interval", ["`--save_interval`", "save_steps", "renamed in ms-swift 4.0",
                                   "recipe key checkpoint.save_steps"]),
    ("megatron", "save", ["output_dir", "run.output_dir"]),
    ("megatron", "load", ["mcore_model"]),
    ("megatron", "adapter_load", ["mcore_adapter", "set by orchestrator on resume"]),
    ("megatron", "eval_interval", ["eval_steps"]),
    ("megatron", "log_interval", ["logging_steps", "checkpoint.logging_steps"]),
    ("megatron", "max_epochs", ["num_train_epochs", "optim.epochs"]),
    ("megatron", "num_workers", ["dataloader_num_workers"]),
    ("megatron", "train_type", ["tuner_type"]),
    ("megatron", "manual_gc_interval", ["manual_gc_steps"]),
    ("megatron", "load_safetensors", ["removed in 4.x"]),
    # backend traps
    ("megatron", "learning_rate", ["use lr", "megatron sft rejects --learning_rate", "optim.lr"]),
    ("megatron", "resume_from_checkpoint", ["mcore_adapter <ckpt> + finetune false", "orchestrator adds these"]),
    ("megatron", "max_steps", ["train_iters", "optim.iterations"]),
    ("megatron", "per_device_train_batch_size", ["micro_batch_size"]),
    ("megatron", "warmup_ratio", ["lr_warmup_fraction"]),
    ("megatron", "gradient_accumulation_steps", ["global_batch_size"]),
    # fictional flags
    ("megatron", "use_megatron", ["does not exist", "`megatron sft` command", 'run.backend = "megatron"']),
    ("megatron", "megatron_use_mcore", ["does not exist", 'run.backend = "megatron"']),
    ("megatron", "use_mcore", ["does not exist", 'run.backend = "megatron"']),
    ("swift", "use_megatron", ["does not exist", 'run.backend = "megatron"']),
    ("swift", "megatron_use_mcore", ['run.backend = "megatron"']),
    ("swift", "use_mcore", ['run.backend = "megatron"']),
    # swift sft
    ("swift", "train_type", ["use tuner_type"]),
    ("swift", "lr", ["use learning_rate", "optim.lr"]),
    ("swift", "train_iters", ["max_steps", "optim.iterations"]),
    ("swift", "micro_batch_size", ["per_device_train_batch_size"]),
    ("swift", "lr_warmup_fraction", ["warmup_ratio"]),
    ("swift", "save_interval", ["save_steps"]),
    ("swift", "mcore_adapter", ["resume_from_checkpoint"]),
    ("swift", "finetune", ["resume_from_checkpoint"]),
    ("swift", "merge_lora", ["swift export"]),
    ("swift", "no_save_optim", ["save_only_model"]),
    ("swift", "expert_model_parallel_size", ['run.backend = "megatron"']),
    ("swift", "recompute_granularity", ["gradient_checkpointing"]),
    # dash forms and leading dashes are normalised before the lookup
    ("megatron", "--save-interval", ["`--save_interval`", "save_steps"]),
    ("megatron", "--learning-rate", ["use lr"]),
    ("swift", "--train-type", ["tuner_type"]),
    # prefixes argparse would accept are rejected, naming the full flag
    ("megatron", "save_total", ["abbreviation", "--save_total_limit", "in full"]),
    ("megatron", "--lr-warmup-frac", ["abbreviation", "--lr_warmup_fraction"]),
    ("megatron", "expert_model", ["abbreviation", "--expert_model_parallel_size"]),
    ("swift", "max_step", ["abbreviation", "--max_steps"]),
    ("swift", "per_device_train", ["abbreviation", "--per_device_train_batch_size"]),
    # HfArgumentParser's --no_X negation of a boolean
    ("megatron", "no_finetune", ["`finetune`", "false"]),
    ("megatron", "--no-add-version", ["`add_version`", "false"]),
    ("swift", "no_check_model", ["`check_model`", "false"]),
    # typos get a suggestion
    ("megatron", "expert_model_paralel_size", ["did you mean", "`--expert_model_parallel_size`"]),
    ("megatron", "recompute_granularty", ["did you mean", "`--recompute_granularity`"]),
    ("megatron", "optimiser_cpu_offload", ["did you mean", "`--optimizer_cpu_offload`"]),
    ("swift", "learnig_rate", ["did you mean", "`--learning_rate`"]),
    ("swift", "per_device_train_batchsize", ["did you mean", "`--per_device_train_batch_size`"]),
]


@pytest.mark.parametrize("backend,name,fragments", REJECTED, ids=[f"{b}:{n}" for b, n, _ in REJECTED])
def test_check_flag_rejects(backend, name, fragments):
    message = check_flag(backend, name)
    assert message is not None
    cmd = f"`{backend} sft`"
    assert cmd in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


ACCEPTED = [
    ("megatron", "save_steps"), ("megatron", "--save_steps"), ("megatron", "--save-steps"), ("megatron", "save-steps"),
    ("megatron", "-save_steps"), ("megatron", "--lr-warmup-fraction"), ("megatron", "no_save_optim"),
    ("megatron", "--no-save-optim"), ("megatron", "moe_aux_loss_coeff"), ("megatron", "sequence_parallel_size"),
    ("swift", "--learning-rate"), ("swift", "learning_rate"), ("swift", "--per-device-train-batch-size"),
    ("swift", "resume_from_checkpoint"), ("swift", "enable_jit_checkpoint"), ("swift", "max_epochs"),
]


@pytest.mark.parametrize("backend,name", ACCEPTED)
def test_check_flag_accepts(backend, name):
    assert check_flag(backend, name) is None


@pytest.mark.parametrize("backend", flags.BACKENDS)
def test_check_flag_known_round_trip(backend):
    for name in KNOWN[backend]:
        assert check_flag(backend, name) is None
        assert check_flag(backend, "--" + name.replace("_", "-")) is None


@pytest.mark.parametrize("backend,name", [("megatron", "zzqqxx_wibble"), ("swift", "zzqqxx_wibble")])
def test_check_flag_unknown_without_suggestion(backend, name):
    assert check_flag(backend, name) == f"`--{name}` is not an ms-swift 4.6.0 `{backend} sft` flag"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        check_flag("deepspeed", "lr")
    with pytest.raises(ValueError):
        check_extra_arg("", "lr")


def test_empty_name():
    assert "empty flag name" in check_flag("megatron", "--")


# --- the tables themselves -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", flags.BACKENDS)
def test_managed_flags_are_known(backend):
    assert sorted(set(MANAGED[backend]) - KNOWN[backend]) == []


@pytest.mark.parametrize("backend", flags.BACKENDS)
def test_managed_values_are_recipe_keys_or_reasons(backend):
    for flag, key in MANAGED[backend].items():
        assert re.fullmatch(r"[a-z]+\.[a-z_]+", key) or re.fullmatch(r"\(.+\)", key), (flag, key)


@pytest.mark.parametrize("backend", flags.BACKENDS)
def test_replacements_are_unknown_and_point_at_known_flags(backend):
    for old, hint in REPLACEMENTS[backend].items():
        assert old not in KNOWN[backend], f"{old} is a real {backend} flag: drop the REPLACEMENTS entry"
        assert "\n" not in hint
        lead = hint.split()[0]
        if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", lead):  # the hint starts with a flag name
            assert lead in KNOWN[backend], (old, hint)


def test_brief_renames_present():
    for old in ("save_interval", "save", "load", "adapter_load", "eval_interval", "log_interval", "max_epochs",
                "num_workers", "train_type", "manual_gc_interval", "load_safetensors", "learning_rate",
                "resume_from_checkpoint", "use_megatron", "megatron_use_mcore", "use_mcore", "max_steps"):
        assert old in REPLACEMENTS["megatron"]
    for old in ("train_type", "lr", "use_megatron", "megatron_use_mcore", "use_mcore", "train_iters"):
        assert old in REPLACEMENTS["swift"]


# --- check_extra_arg -----------------------------------------------------------------------------

EXTRA = [
    ("megatron", "save_steps", "set recipe key checkpoint.save_steps instead"),
    ("megatron", "--expert-model-parallel-size", "set recipe key parallel.expert instead"),
    ("megatron", "use_precision_aware_optimizer", "set recipe key memory.precision_aware_optimizer instead"),
    ("megatron", "no_save_optim", "set recipe key checkpoint.keep_optimizer instead"),
    ("megatron", "lr", "set recipe key optim.lr instead"),
    ("megatron", "mcore_adapter", "set by orchestrator on resume"),
    ("megatron", "finetune", "set by orchestrator on resume"),
    ("megatron", "tuner_type", "always set by orchestrator"),
    ("megatron", "add_version", "always set by orchestrator"),
    ("megatron", "save_interval", "save_steps"),          # unknown: check_flag's message
    ("swift", "learning_rate", "set recipe key optim.lr instead"),
    ("swift", "template", "set recipe key model.template instead"),
    ("swift", "target_parameters", "set recipe key lora.target_parameters instead"),
    ("swift", "gradient_accumulation_steps", "derived from optim.global_batch_size"),
    ("swift", "resume_from_checkpoint", "set by orchestrator on resume"),
    ("swift", "lr", "use learning_rate"),
]


@pytest.mark.parametrize("backend,name,fragment", EXTRA)
def test_check_extra_arg_rejects(backend, name, fragment):
    message = check_extra_arg(backend, name)
    assert message is not None and fragment in message, message


@pytest.mark.parametrize("backend,name", [
    ("megatron", "moe_aux_loss_coeff"), ("megatron", "--moe-grouped-gemm"), ("megatron", "attention_backend"),
    ("megatron", "save_total_limit"), ("megatron", "dist_ckpt_optim_fully_reshardable"),
    ("swift", "enable_jit_checkpoint"), ("swift", "dataloader_num_workers"), ("swift", "report_to"),
])
def test_check_extra_arg_accepts(backend, name):
    assert check_extra_arg(backend, name) is None


# --- the table tracks the installed ms-swift -----------------------------------------------------

def _extractor():
    spec = importlib.util.spec_from_file_location("extract_swift_flags", ROOT / "scripts" / "extract_swift_flags.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not SWIFT_INSTALLED, reason="ms-swift is not installed for this interpreter")
def test_table_matches_installed_ms_swift():
    committed = json.loads((ROOT / "orchestrator" / "data" / "swift_flags.json").read_text(encoding="utf-8"))
    assert _extractor().extract() == committed


@pytest.mark.swift
@pytest.mark.skipif(not SWIFT_INSTALLED, reason="ms-swift is not installed for this interpreter")
def test_extractor_agrees_with_the_real_swift_dataclass():
    """The ast reading equals dataclasses.fields() of the imported SftArguments (importable on CPU).

    MegatronSftArguments cannot be imported without megatron-core / TransformerEngine."""
    import dataclasses

    from swift.arguments import SftArguments

    real = sorted(f.name for f in dataclasses.fields(SftArguments) if f.init and not f.name.startswith("_"))
    assert _extractor().extract()["swift"] == real


def test_extractor_script(tmp_path):
    """As a script: writes the table where ms-swift is installed, otherwise fails with a clear message."""
    import subprocess

    script = ROOT / "scripts" / "extract_swift_flags.py"
    out = tmp_path / "flags.json"
    proc = subprocess.run([sys.executable, "-I", str(script), "--output", str(out)], capture_output=True, text=True)
    if SWIFT_INSTALLED:
        assert proc.returncode == 0 and json.loads(out.read_text())["ms_swift_version"]
    else:
        assert proc.returncode != 0 and "not installed" in proc.stderr


@pytest.mark.parametrize("backend", flags.BACKENDS)
def test_renamed_maps_an_unknown_name_to_the_known_4x_flag_its_hint_names(backend):
    """`orchestrator import` renames through RENAMED: the old name must be refused, the new one known, and
    check_flag's hint for the old name must point at the same flag."""
    assert flags.RENAMED[backend]
    for old, new in flags.RENAMED[backend].items():
        assert old not in flags.KNOWN[backend] and new in flags.KNOWN[backend], (old, new)
        assert flags.REPLACEMENTS[backend][old].split()[0] == new, (old, flags.REPLACEMENTS[backend][old])
    assert "lr_scheduler_type" not in flags.RENAMED["megatron"], "values differ (lr_decay_style): not a rename"
