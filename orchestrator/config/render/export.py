"""The final merge of checkpoint.merge = "final": (recipe, checkpoint, output dir, port) -> the ms-swift
export Command. Pure.

megatron: `megatron export --adapters <ckpt> --merge_lora true --to_hf true`: the checkpoint's
adapter_model.safetensors (the sft renders --save_safetensors true) merged into the HF weights by
mcore-bridge, on the same layout as training (the model only fits the GPUs that way).
swift: `swift export --adapters <ckpt> --merge_lora true` (peft's merge_and_unload, then save_pretrained).

Both refuse an existing output_dir unless --exist_ok: a relaunch after a failed export writes again into
the same staging directory, so exist_ok is set; the staging name is not the published name (the
supervisor renames it only after verify_merged). The training's extra_args are sft flags: not passed.
"""
from __future__ import annotations

from orchestrator.config.recipe import Recipe
from orchestrator.config.render.argv import flags
from orchestrator.config.render.command import _backend, environment
from orchestrator.types import Command


def export_arguments(r: Recipe, checkpoint: str, output_dir: str) -> list[str]:
    m, p = r.model, r.parallel
    pairs: list[tuple[str, object]] = [
        ("model", m.path), ("model_type", m.model_type), ("torch_dtype", m.torch_dtype),
        ("adapters", checkpoint), ("merge_lora", True), ("output_dir", output_dir), ("exist_ok", True),
    ]
    if r.run.backend == "megatron":
        pairs += [("to_hf", True), ("test_convert_precision", False),  # a precision test doubles the memory
                  ("tensor_model_parallel_size", p.tensor), ("pipeline_model_parallel_size", p.pipeline),
                  ("expert_model_parallel_size", p.expert), ("expert_tensor_parallel_size", p.expert_tensor)]
    else:
        pairs += [("template", m.template)]
    return flags(pairs)


def render_export(recipe: Recipe, checkpoint: str, output_dir: str, port: int = 29500) -> Command:
    """`port`: the rendezvous port (megatron export runs under torchrun like the training)."""
    backend = _backend(recipe)
    exe = list(recipe.run.entrypoint or [backend.EXECUTABLE])
    return Command(argv=tuple(exe + ["export"] + export_arguments(recipe, checkpoint, output_dir)),
                   env=environment(recipe, port, backend.ENV))
