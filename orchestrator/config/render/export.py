"""The final merge of checkpoint.merge = "final": (recipe, checkpoint, output dir, port) -> the ms-swift
export Command. Pure, except that it reads the model's config.json (for its MTP layers) and looks for
the checkpoint's adapter_model.safetensors (which adapter argument).

megatron: `megatron export --adapters <ckpt> --merge_lora true --to_hf true`: the checkpoint's
adapter_model.safetensors merged into the HF weights by mcore-bridge, on the same layout as training (the
model only fits the GPUs that way); a checkpoint saved without it (--save_safetensors false, the default
for merge = "final") is read from its mcore shards instead: `--mcore_adapter <ckpt>` (ms-swift 4.6
export.py loads the HF base, then load_mcore_checkpoint(load_arg='mcore_adapter'), without optimizer
state: _init_convert sets no_load_optim / no_load_rng).
swift: `swift export --adapters <ckpt> --merge_lora true` (peft's merge_and_unload, then save_pretrained).

Both refuse an existing output_dir unless --exist_ok: a relaunch after a failed export writes again into
the same staging directory, so exist_ok is set; the staging name is not the published name (the
supervisor renames it only after verify_merged). The training's extra_args are sft flags: not passed,
except mtp_num_layers.

MTP (multi-token prediction, Qwen3.5 / Qwen3-Next: `mtp.*` weights, config `mtp_num_hidden_layers`):
mcore-bridge builds an MTP module only when --mtp_num_layers is given (it does not read the count from
config.json), and `megatron export` writes only the modules it built, so without the flag the merged
model silently lacks its mtp.* weights. The export therefore passes the model's own count even when the
training did not train MTP: the bridge loads the original mtp.* weights, the adapter has no LoRA for them
(their LoRA B stays zero, so the merge leaves them unchanged) and saves them back, and config.json keeps
mtp_num_hidden_layers. When the training did train MTP (extra_args.mtp_num_layers), that count is
passed so its MTP LoRA is merged. The swift backend (peft merge in transformers) drops mtp.* on load.
"""
from __future__ import annotations

from pathlib import Path

from orchestrator.config.model_shape import known_config
from orchestrator.config.recipe import Recipe, read_model_config
from orchestrator.config.render.argv import flags
from orchestrator.config.render.command import _backend, environment
from orchestrator.types import Command


MTP_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3.5 / Qwen3-Next; DeepSeek style


def mtp_layers(r: Recipe, model_config: dict | None) -> int | None:
    """The MTP layers the export builds: those the training trained, else the model's own; None if it has none."""
    trained = r.extra_args.get("mtp_num_layers")
    if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
        return trained
    cfg = model_config or {}
    for c in (cfg.get("text_config") or {}, cfg):
        for key in MTP_KEYS:
            if isinstance(c.get(key), int) and not isinstance(c[key], bool) and c[key] > 0:
                return c[key]
    return None


def export_arguments(r: Recipe, checkpoint: str, output_dir: str, model_config: dict | None = None) -> list[str]:
    """`model_config`: the model's config.json (its MTP layer count), when known."""
    m, p = r.model, r.parallel
    hf_adapter = r.run.backend != "megatron" or (Path(checkpoint) / "adapter_model.safetensors").is_file()
    pairs: list[tuple[str, object]] = [
        ("model", m.path), ("model_type", m.model_type), ("torch_dtype", m.torch_dtype),
        ("adapters" if hf_adapter else "mcore_adapter", checkpoint), ("merge_lora", True),
        ("output_dir", output_dir), ("exist_ok", True),
    ]
    if r.run.backend == "megatron":
        pairs += [("to_hf", True), ("test_convert_precision", False),  # a precision test doubles the memory
                  ("tensor_model_parallel_size", p.tensor), ("pipeline_model_parallel_size", p.pipeline),
                  ("expert_model_parallel_size", p.expert), ("expert_tensor_parallel_size", p.expert_tensor),
                  ("mtp_num_layers", mtp_layers(r, model_config))]  # None (not rendered): no MTP
    else:
        pairs += [("template", m.template)]
    return flags(pairs)


def render_export(recipe: Recipe, checkpoint: str, output_dir: str, port: int = 29500) -> Command:
    """`port`: the rendezvous port (megatron export runs under torchrun like the training)."""
    backend = _backend(recipe)
    exe = list(recipe.run.entrypoint or [backend.EXECUTABLE])
    model_config = read_model_config(recipe) or known_config(recipe.model.path)  # the latter: no model dir here
    return Command(argv=tuple(exe + ["export"] + export_arguments(recipe, checkpoint, output_dir, model_config)),
                   env=environment(recipe, port, backend.ENV))
