"""Per-GPU memory estimate for a Megatron LoRA run of a MoE model. Pure; deliberately coarse.

The point is to catch a layout that cannot fit (EP too small, no recompute, optimizer on GPU)
before a 22-hour run is launched, not to predict the allocator to the MiB.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from orchestrator.recipe import Recipe

GIB = 1024**3
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# CUDA context, NCCL buffers, allocator fragmentation under expandable segments: measured field
# overhead on H100/H200 is 4-8 GiB per rank.
RUNTIME_OVERHEAD_GIB = 6.0


@dataclass(frozen=True)
class ModelShape:
    total_params: float
    expert_params: float
    layers: int
    hidden: int
    vocab: int
    experts: int = 0
    moe_inter: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    base_weights_gib: float
    lora_gib: float
    activations_gib: float
    optimizer_gpu_gib: float
    optimizer_cpu_gib: float
    overhead_gib: float
    total_gib: float
    capacity_gib: float | None
    fits: bool | None
    notes: tuple[str, ...]

    def as_dict(self) -> dict:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


# Published configs of the models this tool is built for, used when config.json is not readable
# where `plan` runs (a laptop, CI). Keys are matched against the model directory name.
KNOWN_CONFIGS: dict[str, dict] = {
    "qwen3.5-397b-a17b": {"hidden_size": 4096, "num_hidden_layers": 60, "vocab_size": 248320, "num_experts": 512,
                          "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                          "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
                          "total_params": 397e9},
    "qwen3-235b-a22b": {"hidden_size": 4096, "num_hidden_layers": 94, "vocab_size": 151936, "num_experts": 128,
                        "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "head_dim": 128, "total_params": 235e9},
}


def known_config(model_path: str) -> dict | None:
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    return next((c for key, c in KNOWN_CONFIGS.items() if name.startswith(key)), None)


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def shape_from_config(cfg: dict, total_bytes: int | None = None, dtype_bytes: int = 2) -> ModelShape | None:
    """Parameter counts from a HF config.json (Qwen3-MoE / Qwen3.5-MoE style keys)."""
    c = _text_config(cfg)
    try:
        hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    moe_inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    expert_params = float(layers * experts * 3 * hidden * moe_inter)  # gate, up, down per expert
    if total_bytes:
        total = total_bytes / dtype_bytes
    elif c.get("total_params"):
        total = float(c["total_params"])
    else:
        heads, kv = int(c.get("num_attention_heads", 0)), int(c.get("num_key_value_heads", 0))
        head_dim = int(c.get("head_dim") or (hidden // heads if heads else 0))
        attn = layers * hidden * head_dim * (2 * heads + 2 * kv)
        shared = layers * 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0)
        total = expert_params + attn + shared + 2 * vocab * hidden
    return ModelShape(total, min(expert_params, total), layers, hidden, vocab, experts, moe_inter)


def estimate(recipe: Recipe, shape: ModelShape | None, capacity_gib: float | None) -> MemoryEstimate:
    p, mem, lora, d, o = recipe.parallel, recipe.memory, recipe.lora, recipe.data, recipe.optim
    notes: list[str] = []
    if shape is None:
        notes.append("model config.json not readable here: weights and activations not estimated")
        shape = ModelShape(0, 0, 0, 0, 0)
    wbytes = _DTYPE_BYTES[recipe.model.torch_dtype]
    dense = shape.total_params - shape.expert_params
    # Experts shard over EP x ETP (and PP); everything else over TP (and PP).
    base = (shape.expert_params / (p.expert * p.expert_tensor) + dense / p.tensor) / p.pipeline * wbytes

    # LoRA (all-linear): rank x (in + out) per adapted matrix; 4 attention matrices sharded by TP,
    # 3 matrices per local expert (experts sharded by EP).
    per_layer = 4 * 2 * shape.hidden / p.tensor + shape.experts / p.expert * 3 * (shape.hidden + shape.moe_inter)
    lora_params = shape.layers / p.pipeline * lora.rank * per_layer
    lora_w = lora_params * wbytes
    # Adam on LoRA params: fp32 master + 2 moments (12 B) + fp32 grad (4 B).
    opt_total = lora_params * 16
    offload = mem.optimizer_offload_fraction if mem.optimizer_cpu_offload else 0.0
    opt_gpu, opt_cpu = opt_total * (1 - offload), opt_total * offload

    # Activations: tokens per micro batch on this rank (context parallel splits the sequence).
    tokens = o.micro_batch_size * d.max_length / p.context
    layers_here = shape.layers / p.pipeline
    sp = p.tensor if p.sequence_parallel else 1
    if mem.recompute_granularity == "full":
        # Only each layer's input is kept, plus one layer's working set during its recompute.
        act = tokens * shape.hidden * wbytes * layers_here / sp + tokens * shape.hidden * 34 / p.tensor
    elif mem.recompute_granularity == "selective":
        act = tokens * shape.hidden * 34 * layers_here / p.tensor
    else:
        act = tokens * shape.hidden * 34 * layers_here / p.tensor * 1.5
        notes.append("no activation recompute: activations dominate; consider recompute_granularity = \"full\"")
    act += tokens * shape.vocab * 4 / p.tensor  # fp32 logits for the loss

    total_b = base + lora_w + act + opt_gpu
    total = total_b / GIB + RUNTIME_OVERHEAD_GIB
    fits = None if capacity_gib is None else total <= capacity_gib * 0.95
    if fits is False:
        notes.append(f"estimated {total:.1f} GiB per GPU exceeds 95% of {capacity_gib:.0f} GiB")
    return MemoryEstimate(base / GIB, lora_w / GIB, act / GIB, opt_gpu / GIB, opt_cpu / GIB,
                          RUNTIME_OVERHEAD_GIB, total, capacity_gib, fits, tuple(notes))
