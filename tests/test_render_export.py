"""The final merge's `megatron export` keeps the model's MTP (multi-token prediction) weights."""
from __future__ import annotations

import json

import pytest

from recipes import MODEL_CONFIG, RECIPES
from orchestrator.config import recipe as R
from orchestrator.config.render.export import mtp_layers, render_export

QWEN35_TEXT = {"model_type": "qwen3_5_moe_text", "num_experts": 16, "mtp_num_hidden_layers": 1}


def export_options(argv) -> dict[str, list[str]]:
    argv = list(argv)
    out: dict[str, list[str]] = {}
    for w in argv[argv.index("export") + 1:]:
        if w.startswith("--"):
            out[w[2:]] = []
            cur = w[2:]
        else:
            out[cur].append(w)
    return out


def recipe_with_model(write_recipe, tmp_path, config: dict, **sections):
    path = write_recipe(**sections)
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return R.load(path)


def test_shipped_397b_export_builds_the_mtp_layer():
    """No model dir where the tests run: the published config (model_shape.KNOWN_CONFIGS) says 1 MTP layer."""
    (path,) = [p for p in RECIPES if p.name == "qwen3.5-397b-a17b-lora-ep8.toml"]
    r = R.load(path)
    assert "mtp_num_layers" not in r.extra_args  # the training does not train MTP (see the recipe)
    opts = export_options(render_export(r, "/nvme/ckpt/checkpoint-900", "/nvme/ckpt/merged").argv)
    assert opts["mtp_num_layers"] == ["1"] and opts["merge_lora"] == ["true"] and opts["to_hf"] == ["true"]


def test_shipped_235b_export_has_no_mtp():
    (path,) = [p for p in RECIPES if p.name == "qwen3-235b-a22b-lora-ep8.toml"]
    opts = export_options(render_export(R.load(path), "/c/checkpoint-9", "/c/m").argv)
    assert "mtp_num_layers" not in opts


@pytest.mark.parametrize("config, extra, expected", [
    ({"text_config": QWEN35_TEXT}, {}, ["1"]),                        # Qwen3.5: text_config.mtp_num_hidden_layers
    ({**MODEL_CONFIG, "num_nextn_predict_layers": 2}, {}, ["2"]),     # DeepSeek-style key
    (MODEL_CONFIG, {}, None),                                         # no MTP in the model: no flag
    ({"text_config": {**QWEN35_TEXT, "mtp_num_hidden_layers": 0}}, {}, None),
    ({"text_config": QWEN35_TEXT}, {"mtp_num_layers": 1}, ["1"]),     # trained MTP: its LoRA is merged too
    (MODEL_CONFIG, {"mtp_num_layers": 3}, ["3"]),                     # the trained count wins
])
def test_export_mtp_layers_from_config(write_recipe, tmp_path, config, extra, expected):
    r = recipe_with_model(write_recipe, tmp_path, config, extra_args=extra)
    opts = export_options(render_export(r, "/c/checkpoint-9", "/c/m").argv)
    assert opts.get("mtp_num_layers") == expected


def test_swift_export_never_renders_mtp(write_recipe, tmp_path):
    r = recipe_with_model(write_recipe, tmp_path, {"text_config": QWEN35_TEXT},
                          run={"backend": "swift"}, parallel={"expert": 1, "nproc_per_node": 1})
    assert "mtp_num_layers" not in export_options(render_export(r, "/c/checkpoint-9", "/c/m").argv)


def test_mtp_layers_ignores_non_counts(write_recipe, tmp_path):
    r = recipe_with_model(write_recipe, tmp_path, MODEL_CONFIG)
    assert mtp_layers(r, {"mtp_num_hidden_layers": True}) is None
    assert mtp_layers(r, {"text_config": {"mtp_num_hidden_layers": "1"}}) is None
    assert mtp_layers(r, None) is None


@pytest.mark.parametrize("hf_adapter, flag", [(True, "adapters"), (False, "mcore_adapter")])
def test_megatron_export_reads_the_adapter_the_checkpoint_has(tmp_path, hf_adapter, flag):
    """The shipped recipes save no HF adapter (merge = "final"): the export merges from the mcore shards;
    a checkpoint saved with checkpoint.save_safetensors = true is merged from its adapter_model.safetensors."""
    (path,) = [p for p in RECIPES if p.name == "qwen3.5-397b-a17b-lora-ep8.toml"]
    ckpt = tmp_path / "checkpoint-900"
    ckpt.mkdir()
    if hf_adapter:
        (ckpt / "adapter_model.safetensors").write_bytes(b"")
    opts = export_options(render_export(R.load(path), str(ckpt), str(tmp_path / "merged")).argv)
    assert opts[flag] == [str(ckpt)] and not ({"adapters", "mcore_adapter"} - {flag}) & set(opts)
