"""Storage budget of a run: bytes per save for each part the recipe produces, the local and persistent
bytes retention keeps, and the copy bandwidth publishing needs. Pure (plan.py measures the disks).

Sizes come from the model's config (a HF config.json, or model_shape.KNOWN_CONFIGS) and the LoRA shapes:
- adapter: `adapter_model.safetensors` (PEFT, HF module names: an expert's gate/up/down are 3 matrices,
  linear_qkv is q/k/v_proj, each with its own copy of A), unless megatron saves without it
  (checkpoint.save_safetensors false, the default with merge = "final"),
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

from orchestrator.config.estimate import lora_param_counts, target_kinds
from orchestrator.config.model_shape import shape_from_config
from orchestrator.domain.interval import starting_choice
from orchestrator.config.recipe import Recipe
from orchestrator.types import GIB

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAM_FP32_BYTES = 12          # fp32 master copy + exp_avg + exp_avg_sq per LoRA parameter
RNG_SCHEDULER_BYTES_PER_RANK = 64 << 10

# Seconds per optimizer step when the recipe gives no checkpoint.step_time_s, keyed like
# model_shape.KNOWN_CONFIGS (model directory name prefix):
# - qwen3.5-397b-a17b: the field run on 8x H200 saved every ~30 min at 100 steps per save -> 18 s;
# - qwen3-235b-a22b: ms-swift's examples/megatron/lora/qwen3_235b.sh header, "8 * 80GiB, 3.2s/it".
DEFAULT_STEP_TIME_S: dict[str, float] = {"qwen3.5-397b-a17b": 18.0, "qwen3-235b-a22b": 3.2}
GENERIC_STEP_TIME_S = 10.0
# Local copies kept when checkpoint.keep_local is not set: the resume point and one fallback when older
# copies are also on persistent storage, else three; fewer when the local disk cannot hold that many.
KEEP_LOCAL_CAP = {True: 2, False: 3}

def step_time_default(model_path: str) -> tuple[float, str]:
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    for key, s in DEFAULT_STEP_TIME_S.items():
        if name.startswith(key):
            return s, f"default for {key}; checkpoint.step_time_s overrides"
    return GENERIC_STEP_TIME_S, "generic default; set checkpoint.step_time_s for this model"


def lora_params(cfg: Mapping, rank: int, targets: list[str], layout: str) -> int:
    """LoRA parameters of the whole model: rank x (in + out) per adapted matrix, summed over layers.

    layout "mcore": megatron-core modules (fused linear_qkv, GDN in_proj, linear_fc1 = gate+up), counted by
    estimate.lora_param_counts: one shape derivation for the memory estimate and the checkpoint sizes.
    layout "hf": the PEFT adapter mcore-bridge exports, which splits each fused module into its HF modules
    and copies its A (rank x hidden) to every part, B split between them: linear_qkv -> q_proj, k_proj,
    v_proj; GDN in_proj -> in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5; in_proj_qkvz, in_proj_ba
    on Qwen3-Next); linear_fc1 -> gate_proj, up_proj of each expert, the shared expert and dense MLPs."""
    s = shape_from_config(dict(cfg))
    if s is None:
        return 0
    dense, expert = lora_param_counts(s, rank, targets)
    if layout == "mcore":
        return int(dense + expert)
    c, kinds = cfg.get("text_config") or cfg, target_kinds(targets)
    gdn_parts = 2 if str(c.get("model_type") or cfg.get("model_type") or "").startswith("qwen3_next") else 4
    copies = 0  # extra A matrices in the HF layout
    for kind in s.layer_kinds:
        mixer, mlp = kind.split("+")
        if mixer == "attn" and "attn_in" in kinds:
            copies += 2
        elif mixer == "gdn" and "gdn_in" in kinds:
            copies += gdn_parts - 1
        if "fc1" in kinds:
            copies += s.experts + bool(s.shared_inter) if mlp == "moe" else bool(s.dense_inter)
    return int(dense + expert) + rank * s.hidden * copies


def total_params(cfg: Mapping, total_bytes: int | None, dtype_bytes: int) -> float:
    """The whole model's parameters: from model.safetensors.index.json's total_size when read, else the
    config's total_params (model_shape.KNOWN_CONFIGS), else counted from the shapes (model_shape.py)."""
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
    publish_every_s: float             # the newest save is published at most every checkpoint.publish_interval_s
    publish_bytes_per_s: float         # published_per_save_bytes / publish_every_s
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def per_save_parts(r: Recipe, cfg: Mapping, total_bytes: int | None = None) -> dict[str, int]:
    wbytes = _DTYPE_BYTES[r.model.torch_dtype]
    lora, c = r.lora, r.checkpoint
    hf = lora_params(cfg, lora.rank, lora.target_modules, "hf")
    parts = {"adapter": hf * wbytes} if c.safetensors_every_save(r.run.backend) else {}
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
    being written, and with a persistent_dir the one being published (newer saves may land during its copy);
    a merged copy is deleted once published, so then at most two are local (one being written, one being
    published); with merge = "final", the copies kept plus the export."""
    ckpt = sum(v for k, v in parts.items() if k != "merged")
    merged = parts.get("merged", 0)
    merged_copies = min(keep + 1, 2) if published else keep + 1
    training = (keep + 1 + published) * ckpt + merged_copies * merged
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
    steps = c.save_steps if c.save_steps != "auto" else starting_choice(
        sum(parts.values()), step_s, step_src, None, background_bytes(r, parts), ranks(r)).steps
    interval = steps * step_s
    every = max(interval, c.publish_interval_s)
    return StorageBudget(parts, published, final_merged, keep, source, local, persistent, step_s, step_src,
                         interval, every, published / every if has_persistent else 0.0, tuple(notes))


def background_bytes(r: Recipe, parts: Mapping[str, int]) -> int:
    """What --async_save writes after a save returns: all but the adapter safetensors and the merged copy,
    which ms-swift writes before training goes on; 0 when saves are synchronous."""
    if not r.checkpoint.async_save:
        return 0
    return sum(parts.values()) - parts.get("adapter", 0) - parts.get("merged", 0)


def ranks(r: Recipe) -> int:
    return r.parallel.nproc_per_node * r.parallel.nnodes


def gib(n: float) -> str:
    """Bytes for people: GiB with one decimal, MiB or KiB below 1 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"
