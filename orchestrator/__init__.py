"""orchestrator: a supervisor that keeps multi-day ms-swift LoRA fine-tunes of large MoE models alive."""

__version__ = "0.1.0"
