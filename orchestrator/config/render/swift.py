"""`swift sft` (ms-swift 4.x, transformers Trainer) arguments: the CPU demo and single-node runs."""
from __future__ import annotations

from orchestrator.config.recipe import Recipe
from orchestrator.config.render.argv import chosen_save_steps, flags
from orchestrator.types import Resume

EXECUTABLE = "swift"
ENV: dict[str, str] = {}


def arguments(r: Recipe, resume: Resume | None, save_steps: int | None = None) -> list[str]:
    """`save_steps`: the interval chosen for this launch (required when checkpoint.save_steps is "auto")."""
    m, d, p, lora, o, c = r.model, r.data, r.parallel, r.lora, r.optim, r.checkpoint
    accumulation = o.global_batch_size // (o.micro_batch_size * p.data_parallel)
    pairs = [
        ("model", m.path), ("model_type", m.model_type), ("template", m.template), ("torch_dtype", m.torch_dtype),
        ("tuner_type", "lora"), ("lora_rank", lora.rank), ("lora_alpha", lora.alpha),
        ("lora_dropout", lora.dropout), ("target_modules", lora.target_modules),
        ("target_parameters", lora.target_parameters or None),
        ("dataset", d.dataset), ("val_dataset", d.val_dataset or None), ("max_length", d.max_length),
        ("packing", d.packing), ("split_dataset_ratio", d.split_dataset_ratio),
        ("dataset_num_proc", d.dataset_num_proc), ("dataloader_num_workers", d.dataloader_num_workers),
        # a relaunch reuses the datasets map cache (~/.cache/modelscope/datasets): no preprocessing again
        ("load_from_cache_file", True),
        ("per_device_train_batch_size", o.micro_batch_size), ("gradient_accumulation_steps", accumulation),
        ("num_train_epochs", o.epochs), ("max_steps", o.iterations),
        ("learning_rate", o.lr), ("warmup_ratio", o.warmup_fraction), ("seed", o.seed),
        ("output_dir", r.run.output_dir), ("add_version", False), ("check_model", False),
        ("save_steps", chosen_save_steps(r, save_steps)), ("logging_steps", c.logging_steps),
        ("save_only_model", not c.keep_optimizer), ("save_total_limit", c.save_total_limit),
        ("ddp_timeout", p.ddp_timeout_s),
        # transformers' JIT checkpoint: SIGTERM (a stop, a spot notice) saves the current step first.
        ("enable_jit_checkpoint", c.save_on_stop),
    ]
    if o.min_lr > 0:
        pairs += [("lr_scheduler_type", "cosine_with_min_lr"),
                  ("lr_scheduler_kwargs", f'{{"min_lr": {o.min_lr}}}')]
    if resume is not None:
        pairs.append(("resume_from_checkpoint", resume.path))
        if resume.weights_only:  # saved with save_only_model: there is no optimizer state to load
            pairs.append(("resume_only_model", True))
    return flags(pairs)
