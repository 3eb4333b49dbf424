"""`megatron sft` (ms-swift 4.x) arguments. Every setting that matters is explicit: never left to
ms-swift defaults that changed between versions (finetune, merge_lora, tuner_type, save_optim)."""
from __future__ import annotations

from orchestrator.config.recipe import Recipe
from orchestrator.config.render.argv import chosen_save_steps, flags
from orchestrator.types import Resume

EXECUTABLE = "megatron"
ENV = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # A collective that times out aborts the process (instead of hanging) and dumps the flight recorder.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def arguments(r: Recipe, resume: Resume | None, save_steps: int | None = None) -> list[str]:
    """`save_steps`: the interval chosen for this launch (required when checkpoint.save_steps is "auto")."""
    m, d, p, mem, lora, o, c = r.model, r.data, r.parallel, r.memory, r.lora, r.optim, r.checkpoint
    full = mem.recompute_granularity == "full"
    pairs = [
        ("model", m.path), ("model_type", m.model_type), ("torch_dtype", m.torch_dtype),
        ("tuner_type", "lora"), ("lora_rank", lora.rank), ("lora_alpha", lora.alpha),
        ("lora_dropout", lora.dropout), ("target_modules", lora.target_modules),
        ("tensor_model_parallel_size", p.tensor), ("pipeline_model_parallel_size", p.pipeline),
        ("context_parallel_size", p.context), ("expert_model_parallel_size", p.expert),
        ("expert_tensor_parallel_size", p.expert_tensor), ("sequence_parallel", p.sequence_parallel),
        ("recompute_granularity", mem.recompute_granularity),
        ("recompute_method", mem.recompute_method if full else None),
        ("recompute_num_layers", mem.recompute_num_layers if full else None),
        ("optimizer_cpu_offload", mem.optimizer_cpu_offload),
        ("optimizer_offload_fraction", mem.optimizer_offload_fraction if mem.optimizer_cpu_offload else None),
        ("use_precision_aware_optimizer", mem.precision_aware_optimizer),
        ("dataset", d.dataset), ("val_dataset", d.val_dataset or None), ("max_length", d.max_length),
        ("packing", d.packing), ("split_dataset_ratio", d.split_dataset_ratio),
        ("dataset_num_proc", d.dataset_num_proc), ("dataloader_num_workers", d.dataloader_num_workers),
        # a relaunch reuses the datasets map cache (~/.cache/modelscope/datasets): no preprocessing again
        ("load_from_cache_file", True),
        ("micro_batch_size", o.micro_batch_size), ("global_batch_size", o.global_batch_size),
        ("num_train_epochs", None if o.epochs is None else int(o.epochs)),  # an int in megatron sft
        ("train_iters", o.iterations),
        ("lr", o.lr), ("min_lr", o.min_lr), ("lr_warmup_fraction", o.warmup_fraction), ("seed", o.seed),
        ("output_dir", r.run.output_dir), ("add_version", False), ("check_model", False),
        ("save_steps", chosen_save_steps(r, save_steps)), ("logging_steps", c.logging_steps),
        # merge "final" + keep_optimizer: no HF adapter per save (the mcore shards hold it; the export reads them)
        ("save_safetensors", c.safetensors_every_save("megatron")),
        ("merge_lora", c.merge == "every_save"),  # "final": exported after training
        ("no_save_optim", not c.keep_optimizer), ("no_save_rng", not c.keep_optimizer),
        ("save_total_limit", c.save_total_limit), ("ddp_timeout", p.ddp_timeout_s),
        # the shards written in the background; complete once last-checkpoint names it (store/checkpoints.py)
        ("async_save", c.async_save),
        # megatron-core 0.16's forked async save frees its pinned copies of the GPU tensors while the child still
        # writes them, and pinned memory is shared across fork, not copy-on-write (NVIDIA/Megatron-LM PR #2288):
        # the DataLoader's pinned batches could reuse them and overwrite LoRA weights in the checkpoint. Batches
        # of a few KiB lose nothing unpinned; extra_args.dataloader_pin_memory still wins.
        ("dataloader_pin_memory", False if c.async_save and "dataloader_pin_memory" not in r.extra_args else None),
    ]
    if resume is None:
        pairs.append(("finetune", True))
    elif resume.weights_only:
        # No optimizer state was saved: weights + iteration only (optimizer and LR schedule restart).
        pairs += [("adapters", resume.path), ("finetune", False)]
    else:
        pairs += [("mcore_adapter", resume.path), ("finetune", False)]
    return flags(pairs)
