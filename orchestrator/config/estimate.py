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

from orchestrator.config.model_shape import ModelShape, dense_params, mixer_dims, structured
from orchestrator.config.recipe import Recipe
from orchestrator.types import GIB

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
        d: dict = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["terms"] = [{**t, "gib": round(t["gib"], 3)} for t in d["terms"]]
        return d


# --- weights -------------------------------------------------------------------------------------

def base_weight_params(r: Recipe, s: ModelShape) -> float:
    """Frozen parameters on the busiest rank."""
    p = r.parallel
    experts = s.expert_params / (p.expert * p.expert_tensor) / p.pipeline
    if not structured(s):
        return experts + (s.total_params - s.expert_params) / p.tensor / p.pipeline
    embed = s.vocab * s.hidden * (1 if s.tied_embeddings or p.pipeline > 1 else 2) / p.tensor
    layers = (dense_params(s) - s.vocab * s.hidden * (1 if s.tied_embeddings else 2)) / p.tensor / p.pipeline
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
        a, b, c, d = mixer_dims(s, mixer) if s.heads else (s.hidden, s.hidden, s.hidden, s.hidden)
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
        _, qkv, q, _ = mixer_dims(s, mixer)
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
