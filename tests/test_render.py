"""Rendering recipes into real ms-swift 4.x `megatron sft` / `swift sft` commands."""
from __future__ import annotations

import pytest

from recipes import DROP, RECIPES
from orchestrator.config import recipe as R
from orchestrator.config import flags
from orchestrator.config.render import command
from orchestrator.config.render.argv import flags as argv_flags, value as argv_value
from orchestrator.types import Resume

FRESH = None
RESUME = Resume("/ckpt/checkpoint-200", 200)
WEIGHTS = Resume("/ckpt/checkpoint-200", 200, weights_only=True)
RESUMES = {"fresh": FRESH, "resume": RESUME, "weights": WEIGHTS}
EXE = {"megatron": "megatron", "swift": "swift"}


def render_command(r, resume, port, save_steps=None):
    """One launch's command; a save_steps = "auto" recipe (the shipped large ones) with an interval chosen as
    the supervisor would (10: what `plan` starts the 397B recipe with)."""
    chosen = save_steps or (10 if r.checkpoint.save_steps == "auto" else None)
    return command.render_command(r, resume, port, chosen)


def args_after_sft(argv) -> list[str]:
    argv = list(argv)
    return argv[argv.index("sft") + 1:]


def options(argv) -> dict[str, list[str]]:
    """--flag -> its value words (the flag must appear once)."""
    out: dict[str, list[str]] = {}
    cur = None
    for w in args_after_sft(argv):
        if w.startswith("--"):
            cur = w[2:]
            assert cur not in out, f"--{cur} given twice"
            out[cur] = []
        else:
            assert cur is not None, f"value {w!r} before any flag"
            out[cur].append(w)
    return out


@pytest.fixture(scope="module")
def shipped():
    return {p.name: R.load(p) for p in RECIPES}


@pytest.fixture
def megatron(write_recipe):
    return R.load(write_recipe())


@pytest.fixture
def swift(write_recipe):
    return R.load(write_recipe(parallel={"expert": 1, "nproc_per_node": 1}, run={"backend": "swift"}))


CASES = [(p.name, k) for p in RECIPES for k in RESUMES]


@pytest.mark.parametrize("name,resume", CASES)
def test_every_flag_is_known(shipped, name, resume):
    r = shipped[name]
    cmd = render_command(r, RESUMES[resume], 29500)
    opts = options(cmd.argv)
    unknown = sorted(f for f in opts if f not in flags.KNOWN[r.run.backend])
    assert unknown == []
    assert all(flags.check_flag(r.run.backend, f) is None for f in opts)


@pytest.mark.parametrize("name,resume", CASES)
def test_no_fictional_or_3x_flags(shipped, name, resume):
    r = shipped[name]
    opts = options(render_command(r, RESUMES[resume], 29500).argv)
    never = {"use_megatron", "megatron_use_mcore", "use_mcore", "save_interval", "train_type", "save", "load",
             "adapter_load", "log_interval", "eval_interval", "max_epochs"}
    never |= {"learning_rate", "resume_from_checkpoint"} if r.run.backend == "megatron" else {"lr", "finetune"}
    assert sorted(never & set(opts)) == []


@pytest.mark.parametrize("name,resume", CASES)
def test_always_explicit(shipped, name, resume):
    r = shipped[name]
    cmd = render_command(r, RESUMES[resume], 29500)
    opts = options(cmd.argv)
    assert cmd.argv[0] == EXE[r.run.backend] and cmd.argv[1] == "sft"
    assert opts["add_version"] == ["false"]
    assert opts["check_model"] == ["false"]
    assert opts["tuner_type"] == ["lora"]
    assert opts["output_dir"] == [r.run.output_dir]
    assert opts["model"] == [r.model.path]
    assert opts["dataset"] == r.data.dataset
    assert opts["save_steps"] == ["10" if r.checkpoint.save_steps == "auto" else str(r.checkpoint.save_steps)]
    if r.run.backend == "megatron":
        assert opts["merge_lora"] == [str(r.checkpoint.merge_lora).lower()]
        assert opts["no_save_optim"] == [str(not r.checkpoint.keep_optimizer).lower()]
        assert opts["no_save_rng"] == opts["no_save_optim"]
        assert opts["lr"] == [str(r.optim.lr)]
    else:
        assert opts["save_only_model"] == [str(not r.checkpoint.keep_optimizer).lower()]
        assert opts["learning_rate"] == [str(r.optim.lr)]


MEGATRON_NEVER = ["resume_from_checkpoint"]
SWIFT_NEVER = ["finetune", "mcore_adapter", "adapters", "async_save"]


@pytest.mark.parametrize("backend,resume,present,absent", [
    ("megatron", "fresh", {"finetune": ["true"]}, ["mcore_adapter", "adapters", *MEGATRON_NEVER]),
    ("megatron", "resume", {"mcore_adapter": ["/ckpt/checkpoint-200"], "finetune": ["false"]},
     ["adapters", *MEGATRON_NEVER]),
    ("megatron", "weights", {"adapters": ["/ckpt/checkpoint-200"], "finetune": ["false"]},
     ["mcore_adapter", *MEGATRON_NEVER]),
    ("swift", "fresh", {}, ["resume_from_checkpoint", "resume_only_model", *SWIFT_NEVER]),
    ("swift", "resume", {"resume_from_checkpoint": ["/ckpt/checkpoint-200"]}, ["resume_only_model", *SWIFT_NEVER]),
    ("swift", "weights", {"resume_from_checkpoint": ["/ckpt/checkpoint-200"], "resume_only_model": ["true"]},
     SWIFT_NEVER),
])
def test_resume_flags(request, backend, resume, present, absent):
    opts = options(render_command(request.getfixturevalue(backend), RESUMES[resume], 29500).argv)
    for k, v in present.items():
        assert opts[k] == v
    for k in absent:
        assert k not in opts


@pytest.mark.parametrize("overrides,flag,expected", [
    ([], "num_train_epochs", None),
    ([], "train_iters", ["10"]),
    ([], "expert_model_parallel_size", ["8"]),
    ([], "tensor_model_parallel_size", ["1"]),
    ([], "sequence_parallel", ["false"]),
    ([], "recompute_granularity", ["selective"]),
    ([], "recompute_method", None),
    ([], "optimizer_cpu_offload", ["false"]),
    ([], "optimizer_offload_fraction", None),
    ([], "val_dataset", None),
    ([], "save_total_limit", None),
    ([], "target_modules", ["all-linear"]),
    ([], "ddp_timeout", ["1800"]),
    ([], "merge_lora", ["false"]),
    ([], "no_save_optim", ["false"]),
    (["checkpoint.keep_optimizer=false"], "no_save_optim", ["true"]),
    (["checkpoint.keep_optimizer=false"], "no_save_rng", ["true"]),
    (["checkpoint.merge_lora=true"], "merge_lora", ["true"]),
    (["checkpoint.save_total_limit=3"], "save_total_limit", ["3"]),
    ([], "async_save", ["false"]),
    (["checkpoint.async_save=true"], "async_save", ["true"]),
    ([], "dataloader_pin_memory", None),
    # megatron-core 0.16's forked async save: pinned staging copies freed while the child writes them
    (["checkpoint.async_save=true"], "dataloader_pin_memory", ["false"]),
    (["checkpoint.async_save=true", "extra_args.dataloader_pin_memory=true"], "dataloader_pin_memory", ["true"]),
    ([], "save_safetensors", ["true"]),                                 # merge never: the HF adapter is the export
    (['checkpoint.merge="final"'], "save_safetensors", ["false"]),     # the mcore shards hold it: no copy
    (['checkpoint.merge="final"', "checkpoint.save_safetensors=true"], "save_safetensors", ["true"]),
    (['checkpoint.merge="final"', "checkpoint.keep_optimizer=false"], "save_safetensors", ["true"]),
    (['lora.target_modules=["linear_qkv", "linear_proj"]'], "target_modules", ["linear_qkv", "linear_proj"]),
    (["parallel.tensor=2", "parallel.sequence_parallel=true"], "sequence_parallel", ["true"]),
    (["memory.recompute_granularity=full", "memory.recompute_method=block", "memory.recompute_num_layers=2"],
     "recompute_method", ["block"]),
    (["memory.recompute_granularity=full", "memory.recompute_method=block", "memory.recompute_num_layers=2"],
     "recompute_num_layers", ["2"]),
    (["memory.recompute_granularity=none"], "recompute_granularity", ["none"]),
    (["memory.optimizer_cpu_offload=true", "memory.optimizer_offload_fraction=0.5"], "optimizer_offload_fraction",
     ["0.5"]),
    (["memory.optimizer_cpu_offload=true"], "optimizer_cpu_offload", ["true"]),
    (["optim.iterations=5"], "train_iters", ["5"]),
    (['data.val_dataset=["/v.jsonl"]'], "val_dataset", ["/v.jsonl"]),
    (["data.packing=true"], "packing", ["true"]),
    (["optim.min_lr=1e-6"], "min_lr", ["1e-06"]),
    (["model.model_type=qwen3_moe"], "model_type", ["qwen3_moe"]),
    (["extra_args.moe_aux_loss_coeff=1e-3"], "moe_aux_loss_coeff", ["0.001"]),
    (["extra_args.moe_grouped_gemm=true"], "moe_grouped_gemm", ["true"]),
    (["extra_args.moe_permute_fusion=false"], "moe_permute_fusion", ["false"]),
    (['extra_args.recompute_modules=["core_attn", "moe"]'], "recompute_modules", ["core_attn", "moe"]),
    (['extra_args.attention_backend="fused"'], "attention_backend", ["fused"]),
])
def test_megatron_values(write_recipe, overrides, flag, expected):
    r = R.load(write_recipe(), overrides)
    opts = options(render_command(r, None, 29500).argv)
    assert opts.get(flag) == expected


def test_megatron_epochs_render_as_int(write_recipe):
    """megatron sft declares num_train_epochs: Optional[int]; `1.0` is an argparse error (exit 2)."""
    r = R.load(write_recipe(optim={"iterations": DROP, "epochs": 2.0}))
    opts = options(render_command(r, None, 1).argv)
    assert opts["num_train_epochs"] == ["2"]
    assert "train_iters" not in opts


def test_swift_epochs_stay_float(write_recipe):
    r = R.load(write_recipe(parallel={"expert": 1, "nproc_per_node": 1}, run={"backend": "swift"},
                            optim={"iterations": DROP, "epochs": 1.5}))
    opts = options(render_command(r, None, 1).argv)
    assert opts["num_train_epochs"] == ["1.5"]
    assert "max_steps" not in opts


@pytest.mark.parametrize("name", ["qwen3.5-397b-a17b-lora-ep8.toml", "qwen3-235b-a22b-lora-ep8.toml"])
def test_shipped_epochs_are_ints(shipped, name):
    opts = options(render_command(shipped[name], None, 1).argv)
    assert opts["num_train_epochs"] == ["1"]


@pytest.mark.parametrize("overrides,flag,expected", [
    ([], "per_device_train_batch_size", ["1"]),
    ([], "gradient_accumulation_steps", ["16"]),
    (["parallel.nproc_per_node=2"], "gradient_accumulation_steps", ["8"]),
    (["optim.micro_batch_size=4"], "gradient_accumulation_steps", ["4"]),
    ([], "max_steps", ["10"]),
    ([], "learning_rate", ["0.0001"]),
    ([], "warmup_ratio", ["0.0"]),
    ([], "save_only_model", ["false"]),
    (["checkpoint.keep_optimizer=false"], "save_only_model", ["true"]),
    ([], "lr_scheduler_type", None),
    (["optim.min_lr=1e-5"], "lr_scheduler_type", ["cosine_with_min_lr"]),
    (["optim.min_lr=1e-5"], "lr_scheduler_kwargs", ['{"min_lr": 1e-05}']),
    ([], "template", None),
    (["model.template=qwen3"], "template", ["qwen3"]),
    ([], "target_parameters", None),
    (['lora.target_parameters=["experts.gate_up_proj"]'], "target_parameters", ["experts.gate_up_proj"]),
    ([], "torch_dtype", ["bfloat16"]),
    (['extra_args.report_to="none"'], "report_to", ["none"]),
    (["extra_args.fp16=false"], "fp16", ["false"]),
])
def test_swift_values(write_recipe, overrides, flag, expected):
    r = R.load(write_recipe(parallel={"expert": 1, "nproc_per_node": 1}, run={"backend": "swift"}), overrides)
    opts = options(render_command(r, None, 29500).argv)
    assert opts.get(flag) == expected
    assert set(opts) <= flags.KNOWN["swift"]


def test_qwen35_recipe(shipped):
    cmd = render_command(shipped["qwen3.5-397b-a17b-lora-ep8.toml"], RESUME, 29512)
    opts = options(cmd.argv)
    assert cmd.argv[:2] == ("megatron", "sft")
    assert opts["expert_model_parallel_size"] == ["8"]
    assert opts["recompute_granularity"] == ["full"]
    assert opts["recompute_method"] == ["uniform"]
    assert opts["recompute_num_layers"] == ["1"]
    assert opts["optimizer_cpu_offload"] == ["true"]
    assert opts["optimizer_offload_fraction"] == ["1.0"]
    assert opts["use_precision_aware_optimizer"] == ["true"]
    assert opts["mcore_adapter"] == [RESUME.path] and opts["finetune"] == ["false"]
    assert opts["merge_lora"] == ["false"] and opts["no_save_optim"] == ["false"]  # merge = "final": exported after training
    assert opts["model_type"] == ["qwen3_5_moe"]
    assert cmd.env["NPROC_PER_NODE"] == "8" and cmd.env["MASTER_PORT"] == "29512"


def test_qwen3_235b_recipe(shipped):
    opts = options(render_command(shipped["qwen3-235b-a22b-lora-ep8.toml"], None, 1).argv)
    assert opts["tensor_model_parallel_size"] == ["4"]
    assert opts["expert_model_parallel_size"] == ["8"]
    assert opts["sequence_parallel"] == ["true"]
    assert opts["moe_aux_loss_coeff"] == ["0.001"]


def test_demo_recipe(shipped):
    cmd = render_command(shipped["demo-cpu.toml"], None, 29650)
    opts = options(cmd.argv)
    assert cmd.argv[:2] == ("swift", "sft")
    assert opts["report_to"] == ["none"]
    assert opts["max_steps"] == ["40"]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == ""
    assert "NPROC_PER_NODE" not in cmd.env and "MASTER_PORT" not in cmd.env


# --- environment ---------------------------------------------------------------------------------

@pytest.mark.parametrize("port", [29500, 29577, 40000])
def test_megatron_env(megatron, port):
    env = render_command(megatron, None, port).env
    assert env["NPROC_PER_NODE"] == "8"
    assert env["MASTER_PORT"] == str(port)
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert "NCCL_P2P_DISABLE" not in env
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


@pytest.mark.parametrize("nproc,has_torchrun", [(1, False), (2, True), (4, True)])
def test_swift_env(write_recipe, nproc, has_torchrun):
    r = R.load(write_recipe(parallel={"expert": 1, "nproc_per_node": nproc}, run={"backend": "swift"}))
    env = render_command(r, None, 29999).env
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert ("NPROC_PER_NODE" in env) is has_torchrun
    if has_torchrun:
        assert env["NPROC_PER_NODE"] == str(nproc) and env["MASTER_PORT"] == "29999"


def test_pcie_preset(write_recipe):
    r = R.load(write_recipe(env={"nccl_preset": "pcie"}))
    env = render_command(r, None, 1).env
    assert {k: env[k] for k in command.NCCL_PRESETS["pcie"]} == {
        "NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}


@pytest.mark.parametrize("var,value", [
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
    ("NCCL_P2P_DISABLE", "0"),
    ("HF_HUB_OFFLINE", "0"),
    ("NCCL_DEBUG", "INFO"),
])
def test_recipe_env_vars_win(write_recipe, var, value):
    r = R.load(write_recipe(env={"nccl_preset": "pcie", "vars": {var: value}}))
    assert render_command(r, None, 1).env[var] == value


@pytest.mark.parametrize("entrypoint", [
    ["numactl", "--interleave=all", "megatron"],
    ["python", "-m", "swift.cli._megatron.main"],
    ["/opt/fake_trainer.py"],
])
def test_entrypoint_replaces_executable(write_recipe, entrypoint):
    r = R.load(write_recipe(run={"entrypoint": entrypoint}))
    argv = render_command(r, None, 1).argv
    assert list(argv[:len(entrypoint)]) == entrypoint
    assert argv[len(entrypoint)] == "sft"
    assert "megatron" not in argv[len(entrypoint):] or entrypoint[-1] == "megatron"
    assert argv[len(entrypoint) + 1].startswith("--")


def test_argv_is_tuple_of_strings(shipped):
    for r in shipped.values():
        argv = render_command(r, RESUME, 1).argv
        assert isinstance(argv, tuple) and all(isinstance(w, str) for w in argv)


# --- value / flags helpers -----------------------------------------------------------------------

@pytest.mark.parametrize("v,words", [
    (True, ["true"]),
    (False, ["false"]),
    (0, ["0"]),
    (1, ["1"]),
    (1e-4, ["0.0001"]),
    (2e-5, ["2e-05"]),
    (1.0, ["1.0"]),
    ("a b", ["a b"]),
    ("", [""]),
    (["a", "b"], ["a", "b"]),
    ((1, 2), ["1", "2"]),
    ([True, False], ["true", "false"]),
    ([], []),
])
def test_value(v, words):
    assert argv_value(v) == words


@pytest.mark.parametrize("pairs,argv", [
    ([], []),
    ([("a", None)], []),
    ([("a", False)], ["--a", "false"]),
    ([("a", 0)], ["--a", "0"]),
    ([("a", "")], ["--a", ""]),
    ([("a", ["x", "y"]), ("b", True)], ["--a", "x", "y", "--b", "true"]),
    ([("b", 1), ("a", 2)], ["--b", "1", "--a", "2"]),
])
def test_flags(pairs, argv):
    assert argv_flags(pairs) == argv


def test_core_rendered_flags_are_managed(megatron):
    """The flags the renderer owns cannot also be given through extra_args."""
    rendered = set(options(render_command(megatron, RESUME, 1).argv))
    managed = set(flags.MANAGED["megatron"])
    core = {"expert_model_parallel_size", "tensor_model_parallel_size", "recompute_granularity", "lr",
            "save_steps", "no_save_optim", "merge_lora", "mcore_adapter", "finetune", "tuner_type", "add_version",
            "check_model", "output_dir", "model", "dataset", "train_iters"}
    assert core <= rendered & managed
    assert all(flags.check_extra_arg("megatron", f) for f in core)


@pytest.mark.parametrize("key", ["seed", "val_dataset", "save_total_limit", "async_save"])
def test_extra_arg_the_recipe_already_renders_is_refused(write_recipe, key):
    """A flag rendered from a recipe key but not in flags.MANAGED (the recipe cannot see the renderer)."""
    path = write_recipe(data={"val_dataset": ["v.jsonl"]}, checkpoint={"save_total_limit": 3},
                        extra_args={key: "1"})
    assert R.load(path).extra_args == {key: "1"}  # the recipe alone cannot tell
    with pytest.raises(R.RecipeError) as e:
        R.load(path, checks=[command.rendering_problems])
    assert str(e.value) == f"{path}: extra_args.{key}: --{key} is already rendered from the recipe; set the " \
                           f"recipe key instead (see `orchestrator plan`)"
    with pytest.raises(R.RecipeError) as e:
        R.load(write_recipe(), [f"extra_args.{key}=2", "data.val_dataset=['v.jsonl']", "checkpoint.save_total_limit=3"],
               checks=[command.rendering_problems])
    assert str(e.value).startswith(f"--set 'extra_args.{key}=2': extra_args.{key}: ")
