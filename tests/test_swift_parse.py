"""Every rendered command parsed by ms-swift 4.6.0 itself, the way `megatron sft` / `swift sft` parse it.

tests/support/swift_parse_probe.py runs in a subprocess (its import stubs stay out of this process) and calls
swift.utils.parse_args(MegatronSftArguments | SftArguments, argv): no argv may be left over, and the
classes' __post_init__ checks run (what the probe stubs, and why, is in its docstring).
Local paths are real: a model directory with the model's config.json, a dataset file, checkpoint
directories with what ms-swift reads from them (args.json, adapter_config.json).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import ROOT
from orchestrator.config import model_shape
from orchestrator.ops import tiny
from orchestrator.config import recipe as R
from orchestrator.config.render import command
from orchestrator.config.render.export import render_export
from orchestrator.types import Resume

pytest.importorskip("swift", reason="ms-swift is not installed (scripts/setup.sh --test)")
# Found, not imported: mcore_bridge imports TransformerEngine at import time, which only the probe stubs.
_MISSING = [m for m in ("megatron.core", "mcore_bridge") if importlib.util.find_spec(m.split(".")[0]) is None]
if _MISSING:  # pragma: no cover - the test extra installs both
    pytest.skip(f"{' and '.join(_MISSING)} cannot be imported: pip install 'megatron-core>=0.16,<0.20' "
                "'mcore-bridge>=1.5.0' (scripts/setup.sh --test)", allow_module_level=True)

PROBE = Path(__file__).parent / "support" / "swift_parse_probe.py"
LARGE = {"qwen3.5-397b-a17b-lora-ep8.toml": "qwen3.5-397b-a17b", "qwen3-235b-a22b-lora-ep8.toml": "qwen3-235b-a22b"}


def render_command(r, resume, port, save_steps=None):
    """One launch's command; a save_steps = "auto" recipe (the shipped large ones) with an interval chosen as
    the supervisor would (10: what `plan` starts the 397B recipe with)."""
    chosen = save_steps or (10 if r.checkpoint.save_steps == "auto" else None)
    return command.render_command(r, resume, port, chosen)


def probe(commands) -> list[dict]:
    payload = json.dumps([{"argv": list(c.argv), "env": c.env} for c in commands])
    out = subprocess.run([sys.executable, str(PROBE)], input=payload, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint(d: Path, adapter_target: list[str]) -> Path:
    """What a saved checkpoint holds that ms-swift reads at resume: args.json, adapter_config.json."""
    d.mkdir(parents=True)
    (d / "args.json").write_text(json.dumps({"model": None}))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 64,
                                                       "target_modules": adapter_target}))
    return d


def large_recipe(name: str, tmp: Path) -> R.Recipe:
    model = tmp / Path(R.load(ROOT / "recipes" / name).model.path).name  # ms-swift matches templates by name
    model.mkdir()
    cfg = dict(model_shape.KNOWN_CONFIGS[LARGE[name]])
    cfg.pop("total_params")
    cfg["architectures"] = ["Qwen3_5MoeForConditionalGeneration" if "3.5" in name else "Qwen3MoeForCausalLM"]
    if "vision_config" in cfg:  # Qwen3.5 is multimodal: text keys live under text_config
        vision = cfg.pop("vision_config")
        cfg = {"architectures": cfg["architectures"], "model_type": cfg["model_type"], "text_config": cfg,
               "vision_config": vision, "tie_word_embeddings": False}
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return R.load(ROOT / "recipes" / name, [f"model.path={str(model)!r}", f"data.dataset=[{str(data)!r}]",
                                            f"run.output_dir={str(tmp / 'out')!r}", "run.persistent_dir=''"])


@pytest.mark.parametrize("name", sorted(LARGE))
def test_megatron_recipes_parse(name, tmp_path):
    r = large_recipe(name, tmp_path)
    ckpt = checkpoint(tmp_path / "out" / "checkpoint-100", ["all-linear"])
    commands = [render_command(r, None, 29500), render_command(r, Resume(str(ckpt), 100), 29500),
                render_command(r, Resume(str(ckpt), 100, weights_only=True), 29500)]
    fresh, resume, weights = probe(commands)
    for res in (fresh, resume, weights):
        assert "error" not in res, res.get("trace")
        assert res["remaining"] == []
    assert fresh["parsed"]["tuner_type"] == "lora" and fresh["parsed"]["finetune"] is True
    assert resume["parsed"]["mcore_adapter"] == str(ckpt) and resume["parsed"]["finetune"] is False
    assert weights["parsed"]["adapters"] == [str(ckpt)] and weights["parsed"]["finetune"] is False
    p = fresh["parsed"]
    assert p["world_size"] == r.parallel.nproc_per_node and p["expert_model_parallel_size"] == r.parallel.expert
    assert p["data_parallel_size"] == r.parallel.data_parallel
    assert p["accumulate_allreduce_grads_in_fp32"] is True  # what estimate.py counts: an fp32 grad buffer


@pytest.mark.parametrize("safetensors", [False, True], ids=["mcore_adapter", "adapters"])
@pytest.mark.parametrize("name", sorted(LARGE))
def test_megatron_export_parses(name, safetensors, tmp_path):
    """checkpoint.merge = "final": the export of the last checkpoint, parsed by MegatronExportArguments. The
    shipped recipes save no HF adapter (--save_safetensors false): the export reads the mcore shards."""
    r = large_recipe(name, tmp_path)
    assert r.checkpoint.merge == "final"
    assert "--save_safetensors false" in " ".join(render_command(r, None, 29500).argv)
    ckpt = checkpoint(tmp_path / "out" / "checkpoint-100", ["all-linear"])
    if safetensors:  # saved with checkpoint.save_safetensors = true
        (ckpt / "adapter_model.safetensors").write_bytes(b"")
    # megatron sft's args.json, as far as `megatron export` reads it (load_args_config: the tuner's keys)
    (ckpt / "args.json").write_text(json.dumps({"model": None, "tuner_type": "lora", "lora_rank": 32,
                                                "lora_alpha": 64, "target_modules": ["all-linear"]}))
    staging = tmp_path / "out" / ".partial-checkpoint-100-merged"
    staging.mkdir()  # a relaunch after a failed export finds it there: --exist_ok
    (res,) = probe([render_export(r, str(ckpt), str(staging), 29500)])
    assert "error" not in res, res.get("trace")
    assert res["remaining"] == []
    p = res["parsed"]
    assert p["adapters"] == ([str(ckpt)] if safetensors else []) and p["merge_lora"] is True and p["to_hf"] is True
    assert p["mcore_adapter"] == (None if safetensors else str(ckpt))
    assert p["output_dir"] == str(staging) and p["world_size"] == r.parallel.nproc_per_node
    assert p["expert_model_parallel_size"] == r.parallel.expert


def test_megatron_parser_rejects_what_ms_swift_rejects(tmp_path):
    """The probe is not a rubber stamp: a flag ms-swift does not know is left over, a bad layout raises.

    (Not `--use_megatron`: argparse takes it as the unambiguous prefix of --use_megatron_fsdp.)"""
    r = large_recipe("qwen3-235b-a22b-lora-ep8.toml", tmp_path)
    good = render_command(r, None, 29500)
    unknown = type(good)(argv=good.argv + ("--save_interval", "100"), env=good.env)  # the 3.x name
    bad_batch = type(good)(argv=good.argv + ("--global_batch_size", "3"), env=good.env)
    left, batch = probe([unknown, bad_batch])
    assert left.get("remaining") == ["--save_interval", "100"]
    assert "global batch size" in batch["error"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny"))


def test_demo_recipe_parses(tiny_model, tmp_path):
    r = R.load(ROOT / "orchestrator" / "data" / "demo-cpu.toml",
               [f"model.path={tiny_model['model']!r}", f"data.dataset=[{tiny_model['data']!r}]",
                f"run.output_dir={str(tmp_path / 'out')!r}"])
    ckpt = checkpoint(tmp_path / "out" / "checkpoint-4", ["all-linear"])
    commands = [render_command(r, None, 29500), render_command(r, Resume(str(ckpt), 4), 29500),
                render_command(r, Resume(str(ckpt), 4, weights_only=True), 29500)]
    fresh, resume, weights = probe(commands)
    for res in (fresh, resume, weights):
        assert "error" not in res, res.get("trace")
        assert res["remaining"] == []
    assert resume["parsed"]["resume_from_checkpoint"] == str(ckpt)
    assert weights["parsed"]["resume_only_model"] is True


def test_demo_export_parses(tiny_model, tmp_path):
    r = R.load(ROOT / "orchestrator" / "data" / "demo-cpu.toml",
               [f"model.path={tiny_model['model']!r}", f"data.dataset=[{tiny_model['data']!r}]",
                f"run.output_dir={str(tmp_path / 'out')!r}"])
    assert r.checkpoint.merge == "final"
    ckpt = checkpoint(tmp_path / "out" / "checkpoint-4", ["all-linear"])
    staging = tmp_path / "out" / ".partial-checkpoint-4-merged"
    staging.mkdir()
    (res,) = probe([render_export(r, str(ckpt), str(staging))])
    assert "error" not in res, res.get("trace")
    assert res["remaining"] == []
    assert res["parsed"]["adapters"] == [str(ckpt)] and res["parsed"]["merge_lora"] is True
    assert res["parsed"]["output_dir"] == str(staging)


IMPORTED = {"megatron/lora/moe.sh": "qwen3-235b-a22b", "megatron/lora/qwen3_235b.sh": "qwen3-235b-a22b",
            "megatron/lora/loss_scale.sh": "qwen3-235b-a22b", "megatron/mcore_bridge/lora/moe.sh": "qwen3-235b-a22b"}


def test_imported_commands_parse(tmp_path):
    """`orchestrator import` of ms-swift's own MoE LoRA examples and of the field command: the recipes' commands
    parse with ms-swift's classes, nothing left over (the model and data swapped for local stand-ins of the
    same architecture: ms-swift reads config.json)."""
    from orchestrator.ops.importer import import_script

    examples = ROOT / "tests" / "fixtures" / "ms-swift" / "examples"
    field = ROOT / "tests" / "fixtures" / "field" / "397b-command.sh"
    scripts = {name: ((examples / name).read_text(), shape) for name, shape in IMPORTED.items()}
    scripts["field"] = (field.read_text(), "qwen3.5-397b-a17b")
    commands = []
    for i, (name, (text, shape)) in enumerate(sorted(scripts.items())):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "recipe.toml").write_text(import_script(text, name, d / "recipe.toml", {}).toml)
        stand_in = large_recipe(next(k for k, v in LARGE.items() if v == shape), d)
        r = R.load(d / "recipe.toml", [f"model.path={stand_in.model.path!r}", f"data.dataset={stand_in.data.dataset!r}",
                                        f"run.output_dir={str(d / 'out')!r}"])
        commands.append(render_command(r, None, 29500))
    for name, res in zip(sorted(scripts), probe(commands)):
        assert "error" not in res, (name, res.get("error"), res.get("trace"))
        assert res["remaining"] == [], name


@pytest.mark.parametrize("example", ["train/lora_sft.sh", "train/tuners/lora/train.sh", "train/multi-gpu/ddp/train.sh"])
def test_imported_swift_sft_examples_parse(example, tiny_model, tmp_path):
    """ms-swift's own `swift sft` LoRA examples, imported: SftArguments takes the command (the tiny model and its
    data stand in for the hub ones)."""
    from orchestrator.ops.importer import import_script

    text = (ROOT / "tests" / "fixtures" / "ms-swift" / "examples" / example).read_text()
    (tmp_path / "recipe.toml").write_text(import_script(text, example, tmp_path / "recipe.toml", {}).toml)
    r = R.load(tmp_path / "recipe.toml", [f"model.path={tiny_model['model']!r}", f"data.dataset=[{tiny_model['data']!r}]",
                                          f"run.output_dir={str(tmp_path / 'out')!r}", 'model.torch_dtype="float32"',
                                          'model.template="qwen3"'])  # the stand-in's name matches no template
    (res,) = probe([render_command(r, None, 29500)])
    assert "error" not in res, res.get("trace")
    assert res["remaining"] == []
    p = res["parsed"]
    assert (p["tuner_type"], p["lora_rank"], p["num_train_epochs"]) == ("lora", 8, 1)
    assert p["gradient_accumulation_steps"] == (8 if "ddp" in example else 16)  # as the example's own


OLD = ROOT / "tests" / "fixtures" / "ms-swift-old"
# (the DeepSpeed ones are left out: ms-swift requires the deepspeed package to parse them, a GPU-only install)
OLD_SWIFT = ["v2.6.1/examples/pytorch/llm/scripts/llama3_8b_instruct/lora/sft.sh",
             "v2.6.1/examples/pytorch/llm/scripts/qwen_14b_chat/qlora/sft.sh",
             "v2.6.1/examples/pytorch/llm/scripts/qwen_7b_chat/lora/sft.sh", "v3.5.3/examples/train/qlora/bnb.sh"]


def test_imported_old_swift_sft_examples_parse(tiny_model, tmp_path):
    """ms-swift 2.x and 3.x `swift sft` examples (tune split of tests/fixtures/ms-swift-old), imported with their
    values in 4.x form (`--dtype bf16`, `--deepspeed default-zero3`, `--lora_target_modules ALL`, ...):
    SftArguments takes each command, nothing left over."""
    from orchestrator.ops.importer import import_script

    commands = []
    for i, name in enumerate(OLD_SWIFT):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "recipe.toml").write_text(import_script((OLD / name).read_text(), name, d / "recipe.toml", {}).toml)
        r = R.load(d / "recipe.toml", [f"model.path={tiny_model['model']!r}", f"data.dataset=[{tiny_model['data']!r}]",
                                       f"run.output_dir={str(d / 'out')!r}", 'model.template="qwen3"',
                                       'model.torch_dtype="float32"'])  # this machine has no bf16 GPU
        commands.append(render_command(r, None, 29500))
    for name, res in zip(OLD_SWIFT, probe(commands)):
        assert "error" not in res, (name, res.get("error"), res.get("trace"))
        assert res["remaining"] == [], name


OLD_MEGATRON = ["v3.9.3/examples/megatron/lora/qwen3_235b.sh", "v3.12.6/examples/megatron/lora/qwen3_235b.sh",
                "v3.12.6/examples/megatron/lora/moe.sh"]


def test_imported_old_megatron_examples_parse(tmp_path):
    """ms-swift 3.x `megatron sft` LoRA examples (tune split of tests/fixtures/ms-swift-old: 3.x `--load`,
    `--save`, `--save_interval`, `--max_epochs`, `--load_safetensors`), imported: MegatronSftArguments takes each
    command (a Qwen3-235B-A22B stand-in for the model and the data)."""
    from orchestrator.ops.importer import import_script

    commands = []
    for i, name in enumerate(OLD_MEGATRON):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "recipe.toml").write_text(import_script((OLD / name).read_text(), name, d / "recipe.toml", {}).toml)
        stand_in = large_recipe("qwen3-235b-a22b-lora-ep8.toml", d)
        sets = [f"model.path={stand_in.model.path!r}", f"data.dataset={stand_in.data.dataset!r}",
                f"run.output_dir={str(d / 'out')!r}"]
        r = R.load(d / "recipe.toml", sets)
        if "mcore_model" in r.extra_args:  # 3.x --load, relative: read beside the recipe, where ms-swift must find it
            Path(str(r.extra_args["mcore_model"])).mkdir()
            assert Path(str(r.extra_args["mcore_model"])).parent == d
        commands.append(render_command(r, None, 29500))
    for name, res in zip(OLD_MEGATRON, probe(commands)):
        assert "error" not in res, (name, res.get("error"), res.get("trace"))
        assert res["remaining"] == [], name
