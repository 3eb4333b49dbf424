"""A model's shape from its HF config.json (or the published config of the models this tool is built for):
parameter counts and the layer structure that the memory estimate (estimate.py) and the storage budget
(storage.py) count with. Pure."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    total_params: float
    expert_params: float
    layers: int
    hidden: int
    vocab: int
    experts: int = 0
    moe_inter: int = 0
    # Structure counted from config.json (0 / empty when the config does not say).
    top_k: int = 0
    shared_inter: int = 0
    dense_inter: int = 0          # FFN width of the non-MoE layers
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    attn_gate: bool = False       # Qwen3-Next / Qwen3.5 gated attention: linear_qkv also emits the gate
    layer_kinds: tuple[str, ...] = ()  # per layer "attn" | "gdn", then "+moe" | "+mlp"
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_conv: int = 0
    vision_params: float = 0.0
    tied_embeddings: bool = False


# Published configs of the models this tool is built for, used when config.json is not readable
# where `plan` runs (a laptop, CI). Keys are matched against the model directory name.
KNOWN_CONFIGS: dict[str, dict] = {
    # huggingface.co/Qwen/Qwen3.5-397B-A17B config.json (text_config and vision_config keys that matter)
    "qwen3.5-397b-a17b": {"model_type": "qwen3_5_moe", "hidden_size": 4096, "num_hidden_layers": 60,
                          "vocab_size": 248320, "num_experts": 512, "num_experts_per_tok": 10,
                          "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                          "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
                          "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
                          "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                          "tie_word_embeddings": False, "total_params": 397e9, "mtp_num_hidden_layers": 1,
                          "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                                            "out_hidden_size": 4096, "patch_size": 16, "temporal_patch_size": 2,
                                            "spatial_merge_size": 2, "in_channels": 3,
                                            "num_position_embeddings": 2304}},
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
                        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "head_dim": 128, "tie_word_embeddings": False, "total_params": 235e9},
}


def known_config(model_path: str) -> dict | None:
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    return next((c for key, c in KNOWN_CONFIGS.items() if name.startswith(key)), None)


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def _int(c: dict, *keys: str) -> int:
    return next((int(c[k]) for k in keys if c.get(k)), 0)


def _vision_params(v: dict) -> float:
    """Qwen-VL style vision tower: blocks (qkv, proj, 2-matrix MLP), patch embedding, 2-layer merger."""
    h, depth, inter = _int(v, "hidden_size"), _int(v, "depth"), _int(v, "intermediate_size")
    if not (h and depth):
        return 0.0
    m2 = _int(v, "spatial_merge_size") ** 2 or 1
    patch = (_int(v, "in_channels") or 3) * (_int(v, "temporal_patch_size") or 1) * _int(v, "patch_size") ** 2 * h
    merger = (h * m2) ** 2 + h * m2 * (_int(v, "out_hidden_size") or h)
    return float(depth * (4 * h * h + 2 * h * inter) + patch + merger + _int(v, "num_position_embeddings") * h)


def _layer_kinds(c: dict, layers: int, experts: int) -> tuple[str, ...]:
    types = c.get("layer_types")
    interval = _int(c, "full_attention_interval")
    hybrid = bool(_int(c, "linear_num_value_heads"))
    mixers = [("gdn" if t == "linear_attention" else "attn") for t in types] if isinstance(types, list) and \
        len(types) == layers else [("gdn" if hybrid and interval and (i + 1) % interval else "attn")
                                   for i in range(layers)]
    dense = set(c.get("mlp_only_layers") or [])
    step = _int(c, "decoder_sparse_step") or 1
    mlps = ["moe" if experts and i not in dense and (i + 1) % step == 0 else "mlp" for i in range(layers)]
    return tuple(f"{a}+{b}" for a, b in zip(mixers, mlps))


def shape_from_config(cfg: dict, total_bytes: int | None = None, dtype_bytes: int = 2) -> ModelShape | None:
    """Parameter counts and layer structure from a HF config.json (Qwen3-MoE / Qwen3.5-MoE style keys)."""
    c = _text_config(cfg)
    try:
        hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    moe_inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    kinds = _layer_kinds(c, layers, experts)
    n_moe = sum(k.endswith("+moe") for k in kinds) if experts else 0
    expert_params = float(n_moe * experts * 3 * hidden * moe_inter)  # gate, up, down per expert
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads")
    head_dim = _int(c, "head_dim") or (hidden // heads if heads else 0)
    model_type = str(c.get("model_type") or cfg.get("model_type") or "")
    gate = bool(c.get("attn_output_gate", model_type.startswith(("qwen3_next", "qwen3_5"))))
    vision = _vision_params(cfg.get("vision_config") or {})
    shape = ModelShape(0, 0, layers, hidden, vocab, experts, moe_inter, top_k=_int(c, "num_experts_per_tok"),
                       shared_inter=_int(c, "shared_expert_intermediate_size"),
                       dense_inter=_int(c, "intermediate_size"), heads=heads, kv_heads=kv or heads,
                       head_dim=head_dim, attn_gate=gate, layer_kinds=kinds,
                       gdn_k_heads=_int(c, "linear_num_key_heads"), gdn_v_heads=_int(c, "linear_num_value_heads"),
                       gdn_k_dim=_int(c, "linear_key_head_dim"), gdn_v_dim=_int(c, "linear_value_head_dim"),
                       gdn_conv=_int(c, "linear_conv_kernel_dim"), vision_params=vision,
                       tied_embeddings=bool(c.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))))
    counted = expert_params + dense_params(shape) + vision
    if total_bytes:
        total = total_bytes / dtype_bytes
    elif c.get("total_params"):
        total = float(c["total_params"])
    else:
        total = counted
    return _replace(shape, total_params=total, expert_params=min(expert_params, total))


def _replace(s: ModelShape, **kw) -> ModelShape:
    return ModelShape(**{**asdict(s), **kw})


def mixer_dims(s: ModelShape, kind: str) -> tuple[int, int, int, int]:
    """(in, out) of the mixer's input projection and (in, out) of its output projection."""
    if kind == "gdn":
        qk, v = s.gdn_k_heads * s.gdn_k_dim, s.gdn_v_heads * s.gdn_v_dim
        return s.hidden, 2 * qk + 2 * v + 2 * s.gdn_v_heads, v, s.hidden
    q = s.heads * s.head_dim
    return s.hidden, q * (2 if s.attn_gate else 1) + 2 * s.kv_heads * s.head_dim, q, s.hidden


def _layer_dense_params(s: ModelShape, kind: str) -> float:
    mixer, mlp = kind.split("+")
    a, b, c, d = mixer_dims(s, mixer)
    n = a * b + c * d
    if mixer == "gdn":
        n += (2 * s.gdn_k_heads * s.gdn_k_dim + s.gdn_v_heads * s.gdn_v_dim) * s.gdn_conv
    if mlp == "moe":
        n += s.experts * s.hidden + 3 * s.hidden * s.shared_inter + (s.hidden if s.shared_inter else 0)
    else:
        n += 3 * s.hidden * s.dense_inter
    return float(n)


def dense_params(s: ModelShape) -> float:
    """Everything but the routed experts: layers' mixers, routers, shared experts, embeddings."""
    kinds = s.layer_kinds or ("attn+moe",) * s.layers
    return sum(_layer_dense_params(s, k) for k in kinds) + s.vocab * s.hidden * (1 if s.tied_embeddings else 2)


def structured(s: ModelShape) -> bool:
    return bool(s.heads and s.layer_kinds)
