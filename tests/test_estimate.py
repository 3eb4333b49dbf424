"""The coarse per-GPU memory estimate."""
from __future__ import annotations

import pytest

from recipes import MINIMAL, ROOT, merge
from orchestrator.config import estimate as E
from orchestrator.config import model_shape as M
from orchestrator.ops import plan
from orchestrator.config import recipe as R
from orchestrator.types import GpuSnapshot

# Qwen3-30B-A3B config.json (the keys that matter): 30.5B parameters in total.
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "num_hidden_layers": 48, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
             "moe_intermediate_size": 768, "intermediate_size": 6144, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False}
SHAPE = M.shape_from_config(M.KNOWN_CONFIGS["qwen3-235b-a22b"])
NO_CAPACITY = GpuSnapshot(error="no driver")


def recipe(*overrides: str, **sections) -> R.Recipe:
    data = merge(merge(MINIMAL, {"model": {"path": "/models/x"}, "data": {"dataset": ["/d.jsonl"]},
                                 "parallel": {"expert": 1}}), sections)
    return R.validate(R.apply_overrides(data, list(overrides)))


# --- shape_from_config ---------------------------------------------------------------------------

def test_shape_qwen3_moe():
    s = M.shape_from_config(QWEN3_MOE)
    assert (s.layers, s.hidden, s.vocab, s.experts, s.moe_inter) == (48, 2048, 151936, 128, 768)
    assert s.expert_params == 48 * 128 * 3 * 2048 * 768
    assert 30.0e9 < s.total_params < 31.0e9
    assert s.expert_params < s.total_params


@pytest.mark.parametrize("cfg,field,value", [
    ({"text_config": QWEN3_MOE}, "experts", 128),
    ({**QWEN3_MOE, "num_experts": None, "n_routed_experts": 64}, "experts", 64),
    ({**QWEN3_MOE, "num_experts": None, "num_local_experts": 8}, "experts", 8),
    ({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, "experts", 0),
    ({**QWEN3_MOE, "moe_intermediate_size": None}, "moe_inter", 6144),
    ({**QWEN3_MOE, "total_params": 31e9}, "total_params", 31e9),
    ({**QWEN3_MOE, "hidden_size": "2048"}, "hidden", 2048),
])
def test_shape_variants(cfg, field, value):
    assert getattr(M.shape_from_config(cfg), field) == value


def test_shape_total_bytes_win():
    s = M.shape_from_config({**QWEN3_MOE, "total_params": 1e9}, total_bytes=61_000_000_000)
    assert s.total_params == 30.5e9
    assert M.shape_from_config(QWEN3_MOE, total_bytes=8, dtype_bytes=4).total_params == 2


def test_shape_expert_params_capped_by_total():
    s = M.shape_from_config(QWEN3_MOE, total_bytes=2_000)
    assert s.expert_params == s.total_params == 1000


def test_shape_without_head_dim():
    s = M.shape_from_config({k: v for k, v in QWEN3_MOE.items() if k != "head_dim"})
    assert s.total_params < M.shape_from_config(QWEN3_MOE).total_params  # head_dim 2048/32 = 64 < 128


@pytest.mark.parametrize("cfg", [{}, {"hidden_size": 8}, {"hidden_size": 8, "num_hidden_layers": 2},
                                 {"hidden_size": "x", "num_hidden_layers": 2, "vocab_size": 3},
                                 {"hidden_size": None, "num_hidden_layers": 2, "vocab_size": 3},
                                 {"text_config": {"vocab_size": 3}}])
def test_shape_unreadable(cfg):
    assert M.shape_from_config(cfg) is None


@pytest.mark.parametrize("path,key", [
    ("/models/Qwen3.5-397B-A17B", "qwen3.5-397b-a17b"),
    ("/models/Qwen3.5-397B-A17B/", "qwen3.5-397b-a17b"),
    ("/models/Qwen3-235B-A22B-Instruct-2507", "qwen3-235b-a22b"),
    ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"),
    ("/models/Llama-3-8B", None),
    ("/models/qwen3-235b", None),
    ("/models/my-Qwen3-235B-A22B", None),
])
def test_known_config(path, key):
    assert M.known_config(path) is (M.KNOWN_CONFIGS[key] if key else None)


@pytest.mark.parametrize("key,total", [("qwen3.5-397b-a17b", 397e9), ("qwen3-235b-a22b", 235e9)])
def test_known_configs_are_plausible(key, total):
    s = M.shape_from_config(M.KNOWN_CONFIGS[key])
    assert s.total_params == total
    assert 0.8 * total < s.expert_params < total
    assert s.experts in (128, 512)


# --- estimate: sanity and monotonicity -----------------------------------------------------------

def test_more_ep_fewer_weights():
    est = [E.estimate(recipe(parallel={"expert": ep}), SHAPE, None) for ep in (1, 2, 4, 8)]
    weights = [e.base_weights_gib for e in est]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == 4
    assert [e.lora_gib for e in est] == sorted((e.lora_gib for e in est), reverse=True)
    assert [e.total_gib for e in est] == sorted((e.total_gib for e in est), reverse=True)


def test_more_tp_fewer_weights_and_activations():
    est = [E.estimate(recipe(parallel={"tensor": tp}, optim={"global_batch_size": 16}), SHAPE, None)
           for tp in (1, 2, 4, 8)]
    assert len({e.base_weights_gib for e in est}) == 4
    assert [e.base_weights_gib for e in est] == sorted((e.base_weights_gib for e in est), reverse=True)
    assert [e.activations_gib for e in est] == sorted((e.activations_gib for e in est), reverse=True)


def test_pipeline_splits_weights():
    a = E.estimate(recipe(), SHAPE, None)
    b = E.estimate(recipe(parallel={"pipeline": 2}), SHAPE, None)
    assert b.base_weights_gib == pytest.approx(a.base_weights_gib / 2)


def test_recompute_order():
    act = {g: E.estimate(recipe(memory={"recompute_granularity": g}), SHAPE, None).activations_gib
           for g in ("full", "selective", "none")}
    # selective recomputes only core attention, whose flash kernel keeps no s x s matrix: as much as none
    assert act["full"] < act["selective"] <= act["none"]


def test_no_recompute_note():
    e = E.estimate(recipe(memory={"recompute_granularity": "none"}), SHAPE, None)
    assert any("recompute" in n for n in e.notes)
    assert not E.estimate(recipe(), SHAPE, None).notes


def test_sequence_parallel_reduces_full_recompute_activations():
    base = {"tensor": 2, "expert": 1}
    a = E.estimate(recipe(parallel=base, memory={"recompute_granularity": "full"}), SHAPE, None)
    b = E.estimate(recipe(parallel={**base, "sequence_parallel": True}, memory={"recompute_granularity": "full"}),
                   SHAPE, None)
    assert b.activations_gib < a.activations_gib


@pytest.mark.parametrize("field,small,big", [
    ("data.max_length", 1024, 4096),
    ("optim.micro_batch_size", 1, 2),
])
def test_activations_grow(field, small, big):
    a = E.estimate(recipe(f"{field}={small}"), SHAPE, None)
    b = E.estimate(recipe(f"{field}={big}"), SHAPE, None)
    assert b.activations_gib > a.activations_gib
    assert b.base_weights_gib == a.base_weights_gib


def test_context_parallel_splits_activations():
    a = E.estimate(recipe(), SHAPE, None)
    b = E.estimate(recipe(parallel={"context": 2}), SHAPE, None)
    assert b.activations_gib == pytest.approx(a.activations_gib / 2)


def test_lora_rank_linear():
    a = E.estimate(recipe(lora={"rank": 8}), SHAPE, None)
    b = E.estimate(recipe(lora={"rank": 16}), SHAPE, None)
    assert b.lora_gib == pytest.approx(2 * a.lora_gib)
    assert b.optimizer_gpu_gib == pytest.approx(2 * a.optimizer_gpu_gib)


def test_dtype_bytes():
    a = E.estimate(recipe(), SHAPE, None)
    b = E.estimate(recipe(model={"torch_dtype": "float32"}), SHAPE, None)
    assert b.base_weights_gib == pytest.approx(2 * a.base_weights_gib)


@pytest.mark.parametrize("offload,fraction,gpu_share", [
    (False, 1.0, 1.0),
    (False, 0.5, 1.0),   # the fraction only counts with optimizer_cpu_offload
    (True, 1.0, 0.0),
    (True, 0.5, 0.5),
    (True, 0.0, 1.0),
])
def test_optimizer_offload(offload, fraction, gpu_share):
    e = E.estimate(recipe(memory={"optimizer_cpu_offload": offload, "optimizer_offload_fraction": fraction}),
                   SHAPE, None)
    # Adam state 12 B/param; the offloaded share also keeps a pinned fp32 copy of its grads (4 B) on the host.
    state = e.optimizer_gpu_gib + e.optimizer_cpu_gib * 12 / 16
    assert state > 0
    assert e.optimizer_gpu_gib == pytest.approx(state * gpu_share)
    assert e.optimizer_cpu_gib == pytest.approx(state * (1 - gpu_share) * 16 / 12)
    if gpu_share == 0.0:
        assert e.optimizer_gpu_gib == 0


def test_total_is_sum_of_parts():
    e = E.estimate(recipe(), SHAPE, 80)
    parts = e.base_weights_gib + e.lora_gib + e.grad_buffer_gib + e.activations_gib + e.optimizer_gpu_gib + e.overhead_gib
    assert e.total_gib == pytest.approx(parts)
    assert e.overhead_gib == E.RUNTIME_OVERHEAD_GIB
    assert e.margin_gib == pytest.approx(80 - e.total_gib)


def test_terms_add_up_to_total():
    """Every GPU byte is in a listed term; the working set and the loss are not alive at once."""
    e = E.estimate(recipe(), SHAPE, 80)
    t = {x.name: x.gib for x in e.terms}
    gpu = sum(v for k, v in t.items() if k not in ("optimizer_cpu", "recompute_working_set", "loss_logits"))
    assert e.total_gib == pytest.approx(gpu + max(t["recompute_working_set"], t["loss_logits"]))
    assert t["optimizer_cpu"] == pytest.approx(e.optimizer_cpu_gib)
    assert all(x.detail for x in e.terms)


@pytest.mark.parametrize("capacity,fits", [(None, None), (10.0, False), (10_000.0, True)])
def test_fits(capacity, fits):
    e = E.estimate(recipe(parallel={"expert": 8}), SHAPE, capacity)
    assert e.fits is fits
    assert e.capacity_gib == capacity
    assert any("exceeds" in n for n in e.notes) is (fits is False)


def test_fits_uses_95_percent():
    e = E.estimate(recipe(parallel={"expert": 8}), SHAPE, None)
    assert E.estimate(recipe(parallel={"expert": 8}), SHAPE, e.total_gib / 0.95 + 0.01).fits is True
    assert E.estimate(recipe(parallel={"expert": 8}), SHAPE, e.total_gib).fits is False


def test_no_shape():
    e = E.estimate(recipe(), None, 80)
    assert e.base_weights_gib == 0 and e.activations_gib == 0
    assert e.total_gib == pytest.approx(E.RUNTIME_OVERHEAD_GIB)
    assert any("config.json" in n for n in e.notes)


def test_as_dict_rounds():
    d = E.estimate(recipe(), SHAPE, 79.6).as_dict()
    assert set(d) >= {"base_weights_gib", "lora_gib", "grad_buffer_gib", "activations_gib", "optimizer_gpu_gib",
                      "optimizer_cpu_gib", "overhead_gib", "total_gib", "capacity_gib", "margin_gib", "fits", "notes",
                      "terms"}
    assert all(set(t) == {"name", "gib", "detail"} for t in d["terms"])
    assert all(round(v, 2) == v for v in d.values() if isinstance(v, float))


# --- the shipped recipes, through plan.memory and the known configs ------------------------------

@pytest.mark.parametrize("name,capacity", [("qwen3.5-397b-a17b-lora-ep8.toml", 139.8),
                                           ("qwen3-235b-a22b-lora-ep8.toml", 80.0)])
def test_shipped_recipe_fits(name, capacity):
    r = R.load(ROOT / "recipes" / name)
    e = plan.memory(r, NO_CAPACITY)
    assert e.capacity_gib == r.gpu.capacity_gib <= capacity
    assert e.fits is True
    assert e.total_gib <= capacity * 0.95
    assert e.base_weights_gib > 20, "estimated from the known config, not zero"
    assert e.optimizer_gpu_gib == 0 and e.optimizer_cpu_gib > 0


@pytest.mark.parametrize("name,overrides", [
    ("qwen3.5-397b-a17b-lora-ep8.toml", ["parallel.expert=1"]),
    ("qwen3.5-397b-a17b-lora-ep8.toml", ["parallel.expert=2"]),
    ("qwen3.5-397b-a17b-lora-ep8.toml", ["memory.optimizer_cpu_offload=false"]),
    ("qwen3-235b-a22b-lora-ep8.toml", ["parallel.expert=1"]),
    ("qwen3-235b-a22b-lora-ep8.toml", ["parallel.expert=2"]),
])
def test_shipped_recipe_bad_layout_does_not_fit(name, overrides):
    e = plan.memory(R.load(ROOT / "recipes" / name, overrides), NO_CAPACITY)
    assert e.fits is False


def test_demo_recipe_estimate_has_no_capacity():
    e = plan.memory(R.load(ROOT / "recipes" / "demo-cpu.toml"), GpuSnapshot(error="GPU checks disabled"))
    assert e.capacity_gib is None and e.fits is None


# --- counted from the config the way megatron-core / mcore-bridge build the model ----------------

QWEN35 = M.shape_from_config(M.KNOWN_CONFIGS["qwen3.5-397b-a17b"])


def test_qwen35_structure():
    kinds = QWEN35.layer_kinds
    assert len(kinds) == 60 and all(k.endswith("+moe") for k in kinds)
    assert kinds.count("attn+moe") == 15 and kinds[3] == "attn+moe" and kinds[0] == "gdn+moe"  # every 4th layer
    assert QWEN35.attn_gate and QWEN35.vision_params > 0.4e9


@pytest.mark.parametrize("key,total", [("qwen3.5-397b-a17b", 397e9), ("qwen3-235b-a22b", 235e9)])
def test_counted_params_match_published_total(key, total):
    s = M.shape_from_config({k: v for k, v in M.KNOWN_CONFIGS[key].items() if k != "total_params"})
    assert s.total_params == pytest.approx(total, rel=0.005)


def test_layer_types_list_wins_over_interval():
    cfg = {**M.KNOWN_CONFIGS["qwen3.5-397b-a17b"], "num_hidden_layers": 4,
           "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"]}
    assert M.shape_from_config(cfg).layer_kinds == ("attn+moe", "gdn+moe", "gdn+moe", "attn+moe")


def test_dense_layers_of_a_moe():
    s = M.shape_from_config({**QWEN3_MOE, "mlp_only_layers": [0, 1]})
    assert s.layer_kinds[:3] == ("attn+mlp", "attn+mlp", "attn+moe")
    assert s.expert_params == 46 * 128 * 3 * 2048 * 768


def qwen35(*overrides: str) -> R.Recipe:
    return R.load(ROOT / "recipes" / "qwen3.5-397b-a17b-lora-ep8.toml", list(overrides))


def test_lora_all_linear_includes_every_local_expert():
    """mcore linear_fc1 is gate+up fused: A r x h, B 2*inter x r; linear_fc2: A r x inter, B h x r."""
    dense, expert = E.lora_params(qwen35(), QWEN35)
    assert expert == 60 * (512 // 8) * 32 * ((4096 + 2 * 1024) + (1024 + 4096))
    # linear_qkv (q + gate + k + v) and linear_proj on 15 layers, in_proj / out_proj on 45, shared expert on 60.
    attn = 15 * 32 * ((4096 + 32 * 256 * 2 + 2 * 2 * 256) + (32 * 256 + 4096))
    gdn = 45 * 32 * ((4096 + 2 * 16 * 128 + 2 * 64 * 128 + 2 * 64) + (64 * 128 + 4096))
    assert dense == attn + gdn + 60 * 32 * ((4096 + 2 * 1024) + (1024 + 4096))


def test_lora_targets_subset():
    r = qwen35("lora.target_modules=['linear_qkv', 'linear_proj']")
    dense, expert = E.lora_params(r, QWEN35)
    assert expert == 0 and dense == 15 * 32 * ((4096 + 32 * 256 * 2 + 2 * 2 * 256) + (32 * 256 + 4096))


@pytest.mark.parametrize("dtype,grad_bytes", [("bfloat16", 4), ("float16", 2), ("float32", 4)])
def test_grad_buffer_dtype(dtype, grad_bytes):
    """ms-swift 4.6 sets accumulate_allreduce_grads_in_fp32 for bf16: an fp32 buffer even when offloaded."""
    e = E.estimate(qwen35(f"model.torch_dtype={dtype}"), QWEN35, None)
    weight_bytes = 4 if dtype == "float32" else 2
    assert e.grad_buffer_gib == pytest.approx(e.lora_gib / weight_bytes * grad_bytes)
    assert e.optimizer_gpu_gib == 0


def test_optimizer_sharded_by_distributed_optimizer():
    r = qwen35("memory.optimizer_cpu_offload=false")
    dense, expert = E.lora_params(r, QWEN35)
    e = E.estimate(r, QWEN35, None)
    assert e.optimizer_gpu_gib * E.GIB == pytest.approx(12 * (dense / 8 + expert / 1))  # DP 8, expert DP 1


def test_recompute_chunk_grows_working_set():
    work = [{t.name: t.gib for t in E.estimate(qwen35(f"memory.recompute_num_layers={n}"), QWEN35, None).terms}
            for n in (1, 3)]
    assert work[1]["recompute_working_set"] > 1.5 * work[0]["recompute_working_set"]
    assert work[1]["checkpointed_inputs"] == pytest.approx(work[0]["checkpointed_inputs"] / 3)


# The field run (issue 12): EP=8, TP=PP=1, LoRA rank 32 / alpha 64 / all-linear, full recompute uniform
# 3 layers, CPU optimizer offload 1.0, packing + padding-free, max_length 2048, micro-batch 1, global
# batch 8, --no_save_optim true. ms-swift logged memory(GiB) 132.91 (max_memory_reserved, max over ranks).
FIELD_SETTINGS = ["parallel.expert=8", "parallel.tensor=1", "parallel.pipeline=1", "lora.rank=32", "lora.alpha=64",
                  "lora.target_modules=['all-linear']", "memory.recompute_granularity=full",
                  "memory.recompute_method=uniform", "memory.recompute_num_layers=3",
                  "memory.optimizer_cpu_offload=true", "memory.optimizer_offload_fraction=1.0", "data.packing=true",
                  "data.max_length=2048", "optim.micro_batch_size=1", "optim.global_batch_size=8",
                  "checkpoint.keep_optimizer=false"]
FIELD_GIB = 132.91


def test_field_run_within_5_percent(tmp_path):
    from click.testing import CliRunner

    from orchestrator.ops.cli import main

    args = ["plan", str(ROOT / "recipes" / "qwen3.5-397b-a17b-lora-ep8.toml"), "--json", "--set", "gpu.check=false"]
    for s in FIELD_SETTINGS:
        args += ["--set", s]
    res = CliRunner().invoke(main, args)
    import json
    m = json.loads(res.output[res.output.index("{"):])["memory"]
    assert abs(m["total_gib"] - FIELD_GIB) / FIELD_GIB <= 0.05, m
    assert {t["name"] for t in m["terms"]} >= {"base_weights", "lora_weights", "grad_buffer", "optimizer_gpu",
                                                "checkpointed_inputs", "recompute_working_set", "loss_logits",
                                                "runtime", "optimizer_cpu"}
    assert next(t for t in m["terms"] if t["name"] == "grad_buffer")["gib"] > 5


def test_plan_text_lists_every_term_and_the_margin():
    from click.testing import CliRunner

    from orchestrator.ops.cli import main

    res = CliRunner().invoke(main, ["plan", str(ROOT / "recipes" / "qwen3.5-397b-a17b-lora-ep8.toml"),
                                    "--set", "gpu.check=false"])
    e = plan.memory(qwen35("gpu.check=false"), NO_CAPACITY)
    assert f"~{e.total_gib:.1f} GiB of 139.8 GiB, margin {139.8 - e.total_gib:.1f} GiB" in res.output
    for t in e.terms:
        assert f"#   {t.name} " in res.output
