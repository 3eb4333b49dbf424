"""Storage budget of a run: bytes per save for each part the recipe produces, the local and persistent
bytes retention keeps, and the copy bandwidth publishing needs. Pure (plan.py measures the disks).

Sizes come from the model's config (a HF config.json, or estimate.KNOWN_CONFIGS) and the LoRA shapes:
- adapter: `adapter_model.safetensors` (PEFT, HF module names: an expert's gate/up/down are 3 matrices),
  rank x (in + out) parameters per adapted matrix, in the model dtype;
- mcore_shards (megatron, unless keep_optimizer = false, i.e. --no_save_optim): the torch_dist shards
  hold the LoRA weights in megatron-core's fused layout (linear_fc1 = gate+up, linear_qkv) in the model
  dtype plus Adam's fp32 m and v and the fp32 master copy: dtype + 12 bytes per LoRA parameter;
- optimizer (swift): optimizer.pt, Adam m and v in fp32 (8 bytes per LoRA parameter);
- rng_scheduler (unless --no_save_rng / save_only_model): RNG and LR-scheduler state, a few KiB per rank;
- merged (checkpoint.merge = "every_save"): the whole model in the dtype, at every save.
`all-linear` on a MoE adapts every expert's linear layers, which is most of the adapter. The router is not
a linear target of all-linear in ms-swift (`all-router` is separate), nor are embeddings.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from orchestrator.estimate import shape_from_config
from orchestrator.recipe import Recipe

GIB = 1024**3
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAM_FP32_BYTES = 12          # fp32 master copy + exp_avg + exp_avg_sq per LoRA parameter
RNG_SCHEDULER_BYTES_PER_RANK = 64 << 10

# Seconds per optimizer step when the recipe gives no checkpoint.step_time_s, keyed like
# estimate.KNOWN_CONFIGS (model directory name prefix):
# - qwen3.5-397b-a17b: the field run on 8x H200 saved every ~30 min at 100 steps per save -> 18 s;
# - qwen3-235b-a22b: ms-swift's examples/megatron/lora/qwen3_235b.sh header, "8 * 80GiB, 3.2s/it".
DEFAULT_STEP_TIME_S: dict[str, float] = {"qwen3.5-397b-a17b": 18.0, "qwen3-235b-a22b": 3.2}
GENERIC_STEP_TIME_S = 10.0
# Local copies kept when checkpoint.keep_local is not set: the resume point and one fallback when older
# copies are also on persistent storage, else three; fewer when the local disk cannot hold that many.
KEEP_LOCAL_CAP = {True: 2, False: 3}

# LoRA target names (megatron-core and HF) -> the matrix kinds they adapt.
_TARGETS = {
    "qkv": {"linear_qkv", "q_proj", "k_proj", "v_proj", "in_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv",
            "in_proj_z", "in_proj_a", "in_proj_b"},
    "proj": {"linear_proj", "o_proj", "out_proj"},
    "fc1": {"linear_fc1", "gate_proj", "up_proj"},
    "fc2": {"linear_fc2", "down_proj"},
}


def step_time_default(model_path: str) -> tuple[float, str]:
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    for key, s in DEFAULT_STEP_TIME_S.items():
        if name.startswith(key):
            return s, f"default for {key}; checkpoint.step_time_s overrides"
    return GENERIC_STEP_TIME_S, "generic default; set checkpoint.step_time_s for this model"


def _i(c: Mapping, *keys: str) -> int:
    return next((int(c[k]) for k in keys if isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool)), 0)


def lora_params(cfg: Mapping, rank: int, targets: list[str], layout: str) -> int:
    """LoRA parameters: rank x (in + out) per adapted matrix, summed over layers.

    layout "hf": the PEFT adapter file (an expert's gate_proj, up_proj, down_proj are 3 matrices);
    layout "mcore": megatron-core modules (fused linear_fc1 = gate+up, fused linear_qkv).
    Attention uses the fused shape in both (under 1 % of an all-linear MoE adapter)."""
    c = cfg.get("text_config") or cfg
    h, layers = _i(c, "hidden_size"), _i(c, "num_hidden_layers")
    heads, kv = _i(c, "num_attention_heads"), _i(c, "num_key_value_heads") or _i(c, "num_attention_heads")
    hd = _i(c, "head_dim") or (h // heads if heads else 0)
    experts = _i(c, "num_experts", "n_routed_experts", "num_local_experts")
    moe_inter = _i(c, "moe_intermediate_size") if experts else 0
    shared = _i(c, "shared_expert_intermediate_size")
    dense_inter = 0 if experts else _i(c, "intermediate_size")
    want = set(_TARGETS) if "all-linear" in targets else {k for k, names in _TARGETS.items() if names & set(targets)}

    def mlp(inter: int) -> int:  # one gated MLP (an expert, the shared expert or a dense MLP)
        if not inter:
            return 0
        fc1 = (2 * (h + inter) if layout == "hf" else h + 2 * inter) if "fc1" in want else 0
        return fc1 + (inter + h if "fc2" in want else 0)

    # Qwen3-Next / Qwen3.5: gated attention (q_proj also yields the output gate); 3 of 4 layers are
    # Gated DeltaNet (linear attention) when the config says so.
    gated = bool(c.get("attn_output_gate", "linear_num_value_heads" in c))
    full_attn = h + hd * (heads * (2 if gated else 1) + 2 * kv), heads * hd + h
    types = c.get("layer_types")
    if not isinstance(types, list):
        every = _i(c, "full_attention_interval") if "linear_num_value_heads" in c else 0
        types = ["full_attention" if not every or (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    kh, vh = _i(c, "linear_num_key_heads"), _i(c, "linear_num_value_heads")
    kd, vd = _i(c, "linear_key_head_dim"), _i(c, "linear_value_head_dim")
    linear_attn = h + 2 * kh * kd + 2 * vh * vd + 2 * vh, vh * vd + h   # in_proj (q, k, v, z, b, a), out_proj
    per_layer_mlp = experts * mlp(moe_inter) + mlp(shared) + mlp(dense_inter)
    total = 0
    for t in types[:layers]:
        qkv, proj = linear_attn if t == "linear_attention" else full_attn
        total += ("qkv" in want) * qkv + ("proj" in want) * proj + per_layer_mlp
    return rank * total


def total_params(cfg: Mapping, total_bytes: int | None, dtype_bytes: int) -> float:
    """The whole model's parameters: from model.safetensors.index.json's total_size when read, else the
    config's total_params (estimate.KNOWN_CONFIGS), else counted from the shapes (estimate.py)."""
    shape = shape_from_config(dict(cfg), total_bytes, dtype_bytes)
    return shape.total_params if shape else 0.0


@dataclass(frozen=True)
class StorageBudget:
    per_save_bytes: dict[str, int]     # part -> bytes written at every save
    published_per_save_bytes: int      # what publishing copies per save
    final_merged_bytes: int            # checkpoint.merge = "final": the export after the last step
    keep_local: int
    keep_local_source: str             # "recipe", "default" or "budget"
    local_bytes: int                   # output_dir: the copies kept + one being written (or the final export)
    persistent_bytes: int | None       # persistent_dir: keep_persistent + the best-loss copy (+ final merged)
    step_time_s: float
    step_time_source: str
    save_interval_s: float
    publish_bytes_per_s: float         # published_per_save_bytes / (save_steps x step time)
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def per_save_parts(r: Recipe, cfg: Mapping, total_bytes: int | None = None) -> dict[str, int]:
    wbytes = _DTYPE_BYTES[r.model.torch_dtype]
    lora, c = r.lora, r.checkpoint
    hf = lora_params(cfg, lora.rank, lora.target_modules, "hf")
    parts = {"adapter": hf * wbytes}
    if c.keep_optimizer:  # --no_save_optim / --no_save_rng (megatron), --save_only_model (swift) otherwise
        if r.run.backend == "megatron":
            parts["mcore_shards"] = lora_params(cfg, lora.rank, lora.target_modules, "mcore") * (wbytes + ADAM_FP32_BYTES)
        else:
            parts["optimizer"] = hf * 8
        parts["rng_scheduler"] = RNG_SCHEDULER_BYTES_PER_RANK * r.parallel.nproc_per_node
    if c.merge == "every_save":
        parts["merged"] = int(total_params(cfg, total_bytes, wbytes) * wbytes)
    return parts


def local_bytes_for(parts: Mapping[str, int], keep: int, merge: str, final_merged: int, published: bool) -> int:
    """Bytes output_dir must hold with `keep` local copies: while training, the copies kept plus the one
    being written; a merged copy is deleted once published, so with a persistent_dir at most two are local
    (one being written, one being published); with merge = "final", the copies kept plus the export."""
    ckpt = sum(v for k, v in parts.items() if k != "merged")
    merged = parts.get("merged", 0)
    merged_copies = min(keep + 1, 2) if published else keep + 1
    training = (keep + 1) * ckpt + merged_copies * merged
    return max(training, keep * ckpt + final_merged if merge == "final" else 0)


def budget(r: Recipe, cfg: Mapping | None, total_bytes: int | None = None,
           local_available: int | None = None) -> StorageBudget:
    """The storage budget of recipe `r` for a model config. `local_available`: bytes output_dir's disk can
    give this run (free plus what it already holds); it caps the default keep_local."""
    c, notes = r.checkpoint, []
    if not cfg:
        notes.append("model config not readable here and not a known model: checkpoint sizes not estimated")
        cfg = {}
    parts = per_save_parts(r, cfg, total_bytes)
    wbytes = _DTYPE_BYTES[r.model.torch_dtype]
    final_merged = int(total_params(cfg, total_bytes, wbytes) * wbytes) if c.merge == "final" else 0
    has_persistent = r.run.persistent_dir is not None
    published = sum(v for k, v in parts.items() if k != "rng_scheduler")
    if c.keep_local is not None:
        keep, source = c.keep_local, "recipe"
    else:
        keep, source = KEEP_LOCAL_CAP[has_persistent], "default"
        while local_available is not None and keep > 1 and \
                local_bytes_for(parts, keep, c.merge, final_merged, has_persistent) > local_available:
            keep, source = keep - 1, "budget"
    if c.save_total_limit is not None and c.save_total_limit < keep:
        keep = c.save_total_limit
        notes.append(f"checkpoint.save_total_limit = {c.save_total_limit}: ms-swift keeps no more local copies")
    local = local_bytes_for(parts, keep, c.merge, final_merged, has_persistent)
    persistent = (c.keep_persistent + 1) * published + final_merged if has_persistent else None
    step_s, step_src = (c.step_time_s, "checkpoint.step_time_s") if c.step_time_s \
        else step_time_default(r.model.path)
    interval = c.save_steps * step_s
    return StorageBudget(parts, published, final_merged, keep, source, local, persistent, step_s, step_src,
                         interval, published / interval if has_persistent else 0.0, tuple(notes))


def gib(n: float) -> str:
    """Bytes for people: GiB with one decimal, MiB or KiB below 1 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"
