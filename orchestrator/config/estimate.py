"""Per-GPU memory estimate for a `megatron sft` LoRA run of a MoE model. Pure.

Every term is counted from the model's config and the recipe the way ms-swift 4.6 / megatron-core
0.16 / mcore-bridge 1.6 build the run, and listed (`terms`) so an operator sees where the bytes go:
- frozen base weights in the model dtype; experts split over EP x ETP, the rest over TP (embedding
  and output layer on the first / last pipeline stage; the vision tower, frozen, on the first);
- LoRA weights with mcore's shapes: `all-linear` is every TELinear / TELayerNormColumnParallelLinear /
  TEGroupedLinear but the output layer, so attention (linear_qkv, linear_proj), GatedDeltaNet
  (in_proj, out_proj), the shared expert and every local expert (linear_fc1 = gate+up fused:
  A r x h, B 2*inter x r; linear_fc2: A r x inter, B h x r), never the router;
- the DDP gradient buffer of the LoRA params: fp32 for bf16 because ms-swift 4.6 sets
  accumulate_allreduce_grads_in_fp32 (MegatronArguments._map_dtype), and it stays on the GPU even
  with the optimizer offloaded (the precision-aware optimizer reads it as decoupled_grad);
- Adam (fp32 master + 2 moments, 12 B/param) sharded by the distributed optimizer over DP (dense
  LoRA) and expert-DP (expert LoRA), the offloaded fraction on the CPU;
- activations: the input of every recompute chunk, plus the larger of (one chunk recomputed, all its
  layers' saved tensors, plus one layer's gradients) and the loss (bf16 logits + their fp32 copy);
- the runtime: CUDA context, NCCL buffers and the caching allocator's reserve (measured, not modelled).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from orchestrator.config.recipe import Recipe

GIB = 1024**3
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# CUDA context, NCCL buffers, allocator reserve under expandable segments: measured field overhead
# on H100/H200 is 4-8 GiB per rank. The one term not derived from the config.
RUNTIME_OVERHEAD_GIB = 6.0
ADAM_STATE_BYTES = 12  # fp32 master weights + exp_avg + exp_avg_sq
# megatron sft module names (and the HF names swift sft uses) per kind of adapted linear.
_TARGETS = {
    "attn_in": {"linear_qkv", "q_proj", "k_proj", "v_proj"},
    "attn_out": {"linear_proj", "o_proj"},
    "gdn_in": {"in_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"},
    "gdn_out": {"out_proj"},
    "fc1": {"linear_fc1", "gate_proj", "up_proj"},
    "fc2": {"linear_fc2", "down_proj"},
}


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


@dataclass(frozen=True)
class Term:
    name: str
    gib: float
    detail: str


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
    grad_buffer_gib: float = 0.0
    margin_gib: float | None = None
    terms: tuple[Term, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        d = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["terms"] = [{**t, "gib": round(t["gib"], 3)} for t in d["terms"]]
        return d


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
    counted = expert_params + _dense_params(shape) + vision
    if total_bytes:
        total = total_bytes / dtype_bytes
    elif c.get("total_params"):
        total = float(c["total_params"])
    else:
        total = counted
    return _replace(shape, total_params=total, expert_params=min(expert_params, total))


def _replace(s: ModelShape, **kw) -> ModelShape:
    return ModelShape(**{**asdict(s), **kw})


# --- weights -------------------------------------------------------------------------------------

def _mixer_dims(s: ModelShape, kind: str) -> tuple[int, int, int, int]:
    """(in, out) of the mixer's input projection and (in, out) of its output projection."""
    if kind == "gdn":
        qk, v = s.gdn_k_heads * s.gdn_k_dim, s.gdn_v_heads * s.gdn_v_dim
        return s.hidden, 2 * qk + 2 * v + 2 * s.gdn_v_heads, v, s.hidden
    q = s.heads * s.head_dim
    return s.hidden, q * (2 if s.attn_gate else 1) + 2 * s.kv_heads * s.head_dim, q, s.hidden


def _layer_dense_params(s: ModelShape, kind: str) -> float:
    mixer, mlp = kind.split("+")
    a, b, c, d = _mixer_dims(s, mixer)
    n = a * b + c * d
    if mixer == "gdn":
        n += (2 * s.gdn_k_heads * s.gdn_k_dim + s.gdn_v_heads * s.gdn_v_dim) * s.gdn_conv
    if mlp == "moe":
        n += s.experts * s.hidden + 3 * s.hidden * s.shared_inter + (s.hidden if s.shared_inter else 0)
    else:
        n += 3 * s.hidden * s.dense_inter
    return float(n)


def _dense_params(s: ModelShape) -> float:
    """Everything but the routed experts: layers' mixers, routers, shared experts, embeddings."""
    kinds = s.layer_kinds or ("attn+moe",) * s.layers
    return sum(_layer_dense_params(s, k) for k in kinds) + s.vocab * s.hidden * (1 if s.tied_embeddings else 2)


def _structured(s: ModelShape) -> bool:
    return bool(s.heads and s.layer_kinds)


def base_weight_params(r: Recipe, s: ModelShape) -> float:
    """Frozen parameters on the busiest rank."""
    p = r.parallel
    experts = s.expert_params / (p.expert * p.expert_tensor) / p.pipeline
    if not _structured(s):
        return experts + (s.total_params - s.expert_params) / p.tensor / p.pipeline
    embed = s.vocab * s.hidden * (1 if s.tied_embeddings or p.pipeline > 1 else 2) / p.tensor
    layers = (_dense_params(s) - s.vocab * s.hidden * (1 if s.tied_embeddings else 2)) / p.tensor / p.pipeline
    return experts + layers + embed + s.vision_params


def target_kinds(target_modules: list[str]) -> set[str]:
    names = set(target_modules)
    if "all-linear" in names:
        return set(_TARGETS)
    return {kind for kind, aliases in _TARGETS.items() if names & aliases}


def _targets(r: Recipe) -> set[str]:
    return target_kinds(r.lora.target_modules)


def lora_params(r: Recipe, s: ModelShape, per_rank: bool = True) -> tuple[float, float]:
    """(dense, expert) LoRA parameter counts with mcore's shapes; per_rank=False: the whole model."""
    p = r.parallel
    split = (p.tensor, p.expert, p.expert_tensor, p.pipeline) if per_rank else (1, 1, 1, 1)
    return lora_param_counts(s, r.lora.rank, r.lora.target_modules, *split)


def lora_param_counts(s: ModelShape, rank: int, targets: list[str], tp: int = 1, ep: int = 1, etp: int = 1,
                      pp: int = 1) -> tuple[float, float]:
    """(dense, expert) LoRA parameters with mcore's shapes on one rank of a TP x EP x ETP x PP split
    (all 1: the whole model; storage.py counts checkpoints with it)."""
    kinds = target_kinds(targets)

    def col(i: int, o: int, t: int) -> float:  # column parallel: A whole, B split
        return rank * (i + o / t)

    def row(i: int, o: int, t: int) -> float:  # row parallel: A split, B whole
        return rank * (i / t + o)

    dense = expert = 0.0
    for kind in (s.layer_kinds or ("attn+moe",) * s.layers):
        mixer, mlp = kind.split("+")
        a, b, c, d = _mixer_dims(s, mixer) if s.heads else (s.hidden, s.hidden, s.hidden, s.hidden)
        dense += col(a, b, tp) if {"attn": "attn_in", "gdn": "gdn_in"}[mixer] in kinds else 0
        dense += row(c, d, tp) if {"attn": "attn_out", "gdn": "gdn_out"}[mixer] in kinds else 0
        inter, n = (s.moe_inter, s.experts / ep) if mlp == "moe" else (s.dense_inter, 0)
        ffn = (col(s.hidden, 2 * inter, etp) if "fc1" in kinds else 0) + (row(inter, s.hidden, etp) if "fc2" in kinds else 0)
        expert += n * ffn
        if mlp == "moe" and s.shared_inter:
            dense += (col(s.hidden, 2 * s.shared_inter, tp) if "fc1" in kinds else 0) + \
                (row(s.shared_inter, s.hidden, tp) if "fc2" in kinds else 0)
        elif mlp == "mlp":
            dense += (col(s.hidden, 2 * inter, tp) if "fc1" in kinds else 0) + \
                (row(inter, s.hidden, tp) if "fc2" in kinds else 0)
    return dense / pp, expert / pp


# --- activations ---------------------------------------------------------------------------------

def _layer_activation_elems(r: Recipe, s: ModelShape, kind: str) -> float:
    """bf16 elements saved for backward per token of one layer (fp32 counted as 2, bool as 0.5).

    Each adapted linear with lora_dropout > 0 keeps a dropped-out copy of its input plus the mask.
    Hidden-sized tensors split over TP only with sequence parallel; head- and FFN-sized ones over TP.
    """
    p, kinds = r.parallel, _targets(r)
    t, h = p.tensor, s.hidden / (p.tensor if p.sequence_parallel else 1)
    drop = 1.5 if r.lora.dropout > 0 else 0.0
    mixer, mlp = kind.split("+")
    if s.heads:
        _, qkv, q, _ = _mixer_dims(s, mixer)
    else:
        qkv, q = 3 * s.hidden, s.hidden
    lora_in = drop * h if {"attn": "attn_in", "gdn": "gdn_in"}[mixer] in kinds else 0
    lora_out = drop * q / t if {"attn": "attn_out", "gdn": "gdn_out"}[mixer] in kinds else 0
    n = 2 * h + lora_in + qkv / t + lora_out  # layernorm output, residual, projection output
    if mixer == "gdn":
        qk = s.gdn_k_heads * s.gdn_k_dim
        conv = 2 * qk + q
        # conv1d input, output and its activation; l2-normed q, k; fp32 g and beta; core output,
        # gated RMSNorm output and gate product.
        n += (3 * conv + 2 * qk + 4 * s.gdn_v_heads + 3 * q) / t
    else:
        kv = 2 * s.kv_heads * s.head_dim
        # q, k after qk-norm and RoPE; attention output; sigmoid gate and gated output.
        n += (q + kv / 2 + q + (2 * q if s.attn_gate else 0)) / t
    fc1, fc2 = ("fc1" in kinds) * drop, ("fc2" in kinds) * drop
    if mlp == "moe":
        rows = max(s.top_k, 1) / (t if p.sequence_parallel else 1)  # routed copies of each token
        mi = s.moe_inter / p.expert_tensor
        # router logits + probabilities (fp32); per routed row: grouped-GEMM input, its dropped-out
        # copy, fc1 output, activation output, fc2 dropped-out input, unpermute input.
        n += 4 * s.experts / (t if p.sequence_parallel else 1)
        n += rows * (2 * s.hidden + fc1 * s.hidden + 2 * mi + mi + fc2 * mi)
        if s.shared_inter:
            n += h + fc1 * h + 3 * s.shared_inter / t + fc2 * s.shared_inter / t
    else:
        n += h + fc1 * h + 3 * s.dense_inter / t + fc2 * s.dense_inter / t
    return n


def activation_bytes(r: Recipe, s: ModelShape, wbytes: int) -> tuple[float, float, float, str]:
    """(checkpointed inputs, working set, loss section) in bytes, and how the layers are recomputed."""
    p, mem, d, o = r.parallel, r.memory, r.data, r.optim
    tokens = o.micro_batch_size * d.max_length / p.context
    kinds = list(s.layer_kinds or ("attn+moe",) * s.layers)
    kinds = kinds[: math.ceil(len(kinds) / p.pipeline)]  # the first (busiest) stage
    per_layer = [tokens * _layer_activation_elems(r, s, k) * 2 for k in kinds]
    layer_in = tokens * s.hidden * wbytes / (p.tensor if p.sequence_parallel else 1)
    largest = max(per_layer, default=0.0)
    n = mem.recompute_num_layers or 1
    if mem.recompute_granularity == "full" and mem.recompute_method == "block":
        # The first n layers keep only their input; the others keep everything.
        kept = n * layer_in + sum(per_layer[n:])
        work, how = max(per_layer[:n], default=0.0) + largest, f"block: first {n} layers recomputed"
    elif mem.recompute_granularity == "full":
        chunks = [per_layer[i:i + n] for i in range(0, len(per_layer), n)]
        kept = len(chunks) * layer_in
        work, how = max((sum(c) for c in chunks), default=0.0) + largest, f"uniform: {n} layer(s) per chunk"
    else:
        # selective recomputes only core attention, whose flash kernel keeps no s x s matrix anyway.
        kept, work, how = sum(per_layer), largest, mem.recompute_granularity
    kept *= p.pipeline  # 1F1B: the first stage holds one micro batch per stage in flight
    # bf16 logits and the fp32 copy the (fused) vocab-parallel cross entropy keeps for backward.
    loss = tokens * s.vocab / p.tensor * (wbytes + 4)
    return kept, work, loss, how


# --- the estimate --------------------------------------------------------------------------------

def estimate(recipe: Recipe, shape: ModelShape | None, capacity_gib: float | None) -> MemoryEstimate:
    p, mem = recipe.parallel, recipe.memory
    notes: list[str] = []
    if shape is None:
        notes.append("model config.json not readable here: weights and activations not estimated")
        shape = ModelShape(0, 0, 0, 0, 0)
    dtype = recipe.model.torch_dtype
    wbytes = _DTYPE_BYTES[dtype]
    base = base_weight_params(recipe, shape) * wbytes
    lora_dense, lora_expert = lora_params(recipe, shape)
    lora_w = (lora_dense + lora_expert) * wbytes
    # ms-swift 4.6 sets accumulate_allreduce_grads_in_fp32 for bf16: the DDP grad buffer is fp32.
    grad_bytes = 4 if dtype in ("bfloat16", "float32") else 2
    grads = (lora_dense + lora_expert) * grad_bytes
    world = p.nproc_per_node
    dp = max(world // (p.tensor * p.pipeline * p.context), 1)
    edp = max(world // (p.expert * p.expert_tensor * p.pipeline), 1)
    opt_total = ADAM_STATE_BYTES * (lora_dense / dp + lora_expert / edp)
    offload = mem.optimizer_offload_fraction if mem.optimizer_cpu_offload else 0.0
    # The offloaded share lives on the CPU with a pinned fp32 copy of its gradients.
    opt_gpu, opt_cpu = opt_total * (1 - offload), opt_total * offload * (ADAM_STATE_BYTES + 4) / ADAM_STATE_BYTES
    kept, work, loss, how = activation_bytes(recipe, shape, wbytes) if shape.layers else (0.0, 0.0, 0.0, "")
    act = kept + max(work, loss)
    if mem.recompute_granularity == "none":
        notes.append("no activation recompute: activations dominate; consider recompute_granularity = \"full\"")
    total = (base + lora_w + grads + opt_gpu + act) / GIB + RUNTIME_OVERHEAD_GIB
    margin = None if capacity_gib is None else capacity_gib - total
    fits = None if capacity_gib is None else total <= capacity_gib * 0.95
    if fits is False:
        notes.append(f"estimated {total:.1f} GiB per GPU exceeds 95% of {capacity_gib:.0f} GiB")
    el = "expert " if shape.experts else ""
    terms = (
        Term("base_weights", base / GIB, f"frozen {dtype} weights on this rank ({el}EP {p.expert} x ETP "
                                         f"{p.expert_tensor}, TP {p.tensor}, PP {p.pipeline})"),
        Term("lora_weights", lora_w / GIB, f"rank {recipe.lora.rank} adapters, {(lora_dense + lora_expert) / 1e6:.0f}M "
                                           f"params here ({lora_expert / 1e6:.0f}M on local experts)"),
        Term("grad_buffer", grads / GIB, f"DDP gradient buffer of the LoRA params, {grad_bytes} B each"
                                         + (" (accumulate_allreduce_grads_in_fp32)" if grad_bytes == 4 else "")),
        Term("optimizer_gpu", opt_gpu / GIB, f"Adam state on GPU (sharded DP {dp}, expert DP {edp}; "
                                             f"offload fraction {offload:g})"),
        Term("checkpointed_inputs", kept / GIB, f"layer inputs kept for recompute ({how})"),
        Term("recompute_working_set", work / GIB, "one recomputed chunk's saved tensors + one layer's gradients"),
        Term("loss_logits", loss / GIB, "bf16 logits + fp32 copy in cross entropy (not at once with the "
                                        "working set: the larger counts)"),
        Term("runtime", RUNTIME_OVERHEAD_GIB, "CUDA context, NCCL buffers, allocator reserve (measured)"),
        Term("optimizer_cpu", opt_cpu / GIB, "host memory, not GPU: offloaded Adam state + pinned fp32 grads"),
    )
    return MemoryEstimate(base / GIB, lora_w / GIB, act / GIB, opt_gpu / GIB, opt_cpu / GIB,
                          RUNTIME_OVERHEAD_GIB, total, capacity_gib, fits, tuple(notes),
                          grads / GIB, margin, terms)
