"""Storage budget (orchestrator/domain/storage.py) and the disk checks built on it (plan.py): table tests with the
numbers written out for the shipped 397B and 235B recipes, the probe on a real directory, the fatal check on
a real size-limited tmpfs, and the `plan --json` shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes import MODEL_CONFIG, RECIPES, make_model
from orchestrator.config import estimate as E
from orchestrator.host import probe as host_probe
from orchestrator.ops import plan
from orchestrator.domain import storage
from orchestrator.loop import preflight
from orchestrator.config import recipe as R
from orchestrator.ops.cli import main
from orchestrator.config.model_shape import known_config, shape_from_config

GIB, MIB = 1024**3, 1024**2
R397 = next(p for p in RECIPES if p.name.startswith("qwen3.5-397b"))
R235 = next(p for p in RECIPES if p.name.startswith("qwen3-235b"))


def budget_of(path: Path, *overrides: str, available: int | None = None) -> storage.StorageBudget:
    r = R.load(path, list(overrides))
    return storage.budget(r, known_config(r.model.path), None, available)


# --- LoRA shapes ---------------------------------------------------------------------------------

# 397B (known config: 60 layers, hidden 4096, 512 experts of 1024, shared expert 1024; 45 Gated DeltaNet layers
# with 16 key heads + 64 value heads of 128, and 15 gated full-attention layers with 32 heads + 2 KV of 256):
#   mcore per layer: experts 512 x (fc1 4096+2048 + fc2 1024+4096) = 5,767,168, shared 11,264;
#         GDN in_proj 4096 + 2*16*128 + 2*64*128 + 2*64 = 24,704, out_proj 8192 + 4096 = 12,288;
#         attention linear_qkv 4096 + 256 x (2*32 + 2*2) = 21,504 (q doubled by the output gate), linear_proj 12,288
#         -> (60 x 5,778,432 + 45 x 36,992 + 15 x 33,792) x rank 32 = 11,164,078,080
#   hf    the same, plus one more A (4096 each) for every part a fused module is split into on export:
#         experts 512 x (gate 4096+1024 + up 4096+1024 + down 1024+4096) = 7,864,320, shared 15,360;
#         GDN in_proj_qkv/z/b/a 4 x 4096 + 20,608 = 36,992, out_proj 12,288;
#         attention q/k/v_proj 3 x 4096 + 17,408 = 29,696, o_proj 12,288
#         -> (60 x 7,879,680 + 45 x 49,280 + 15 x 41,984) x 32 = 15,220,101,120
# 235B (94 layers, hidden 4096, 128 experts of 1536, 64 heads + 4 KV of 128, no gate), rank 16:
#   hf    per layer: experts 128 x 16,896 = 2,162,688, attention 3 x 4096 + 9,216 = 21,504 + 12,288
#         -> 2,196,480 x 94 x 16
#   mcore per layer: experts 128 x 12,800 = 1,638,400, attention 13,312 + 12,288 -> 1,664,000 x 94 x 16
@pytest.mark.parametrize("model,rank,targets,layout,params", [
    ("qwen3.5-397b-a17b", 32, ["all-linear"], "hf", 15_220_101_120),
    ("qwen3.5-397b-a17b", 32, ["all-linear"], "mcore", 11_164_078_080),
    ("qwen3-235b-a22b", 16, ["all-linear"], "hf", 3_303_505_920),
    ("qwen3-235b-a22b", 16, ["all-linear"], "mcore", 2_502_656_000),
    # attention only: the experts are most of an all-linear MoE adapter; only the 15 full-attention layers
    # have linear_qkv / q_proj (GDN's in_proj, out_proj are other targets)
    ("qwen3.5-397b-a17b", 32, ["linear_qkv", "linear_proj"], "mcore", (21_504 + 12_288) * 15 * 32),
    ("qwen3.5-397b-a17b", 32, ["q_proj", "k_proj", "v_proj", "o_proj"], "hf", (29_696 + 12_288) * 15 * 32),
    ("qwen3.5-397b-a17b", 32, ["in_proj", "out_proj"], "mcore", (24_704 + 12_288) * 45 * 32),
    ("qwen3.5-397b-a17b", 32, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], "hf",
     (36_992 + 12_288) * 45 * 32),
    ("qwen3-235b-a22b", 16, ["linear_fc2"], "mcore", 128 * (1536 + 4096) * 94 * 16),
    ("qwen3-235b-a22b", 16, ["not_a_module"], "hf", 0),
])
def test_lora_params(model, rank, targets, layout, params):
    assert storage.lora_params(known_config(f"/models/{model}"), rank, targets, layout) == params


def test_lora_params_from_a_hybrid_config_json():
    """Qwen3.5's own config.json: keys under text_config, the layer kinds as a layer_types list (here the last
    of every 4 layers is full attention, as in the real file): the same count as the known config."""
    known = known_config("/m/qwen3.5-397b-a17b")
    text = {k: v for k, v in known.items() if k not in ("full_attention_interval", "vision_config")}
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)]
    cfg = {"model_type": "qwen3_5_moe", "text_config": {**text, "layer_types": types}}
    assert storage.lora_params(cfg, 32, ["all-linear"], "hf") == 15_220_101_120
    assert storage.lora_params(cfg, 32, ["all-linear"], "mcore") == 11_164_078_080
    # Qwen3-Next exports GDN's in_proj as 2 HF modules (in_proj_qkvz, in_proj_ba): 2 A copies fewer per layer
    next_cfg = {"text_config": {**text, "layer_types": types, "model_type": "qwen3_next"}}
    assert storage.lora_params(next_cfg, 32, ["all-linear"], "hf") == 15_220_101_120 - 45 * 2 * 4096 * 32


def test_mcore_count_is_the_memory_estimates():
    """One shape derivation: the checkpoint's mcore LoRA parameters are the memory estimate's, whose shipped
    recipe (EP 8) holds 91.1M dense + 1384.1M expert = 1475M per GPU (5,767,168 x 60 x 32 / 8 on experts)."""
    r = R.load(R397)
    shape = shape_from_config(known_config(r.model.path))
    dense, expert = E.lora_params(r, shape)
    assert (dense, expert) == (91_115_520, 5_767_168 * 60 * 32 / 8) and round((dense + expert) / 1e6) == 1475
    whole = storage.lora_params(known_config(r.model.path), r.lora.rank, r.lora.target_modules, "mcore")
    assert whole == sum(E.lora_params(r, shape, per_rank=False)) == 11_164_078_080


# --- per save, local, persistent, bandwidth --------------------------------------------------------

ADAPTER_397, SHARDS_397, MERGED_397 = 15_220_101_120 * 2, 11_164_078_080 * 14, 397_000_000_000 * 2
RNG_8 = 8 * 64 * 1024
CKPT_397 = ADAPTER_397 + SHARDS_397 + RNG_8
ST = "checkpoint.save_safetensors=true"  # merge = "final" saving the HF adapter at every save as well


@pytest.mark.parametrize("path,overrides,parts", [
    # the merged copy is the whole model in bf16: 794e9 bytes = 739.5 GiB for 397B, 437.7 GiB for 235B
    (R397, ['checkpoint.merge="every_save"'],
     {"adapter": ADAPTER_397, "mcore_shards": SHARDS_397, "rng_scheduler": RNG_8, "merged": MERGED_397}),
    # merge = "final": no HF adapter per save (the mcore shards hold the LoRA weights; the export reads them)
    (R397, [], {"mcore_shards": SHARDS_397, "rng_scheduler": RNG_8}),
    (R397, [ST], {"adapter": ADAPTER_397, "mcore_shards": SHARDS_397, "rng_scheduler": RNG_8}),
    (R397, ["checkpoint.keep_optimizer=false"], {"adapter": ADAPTER_397}),  # --no_save_optim --no_save_rng
    (R235, ['checkpoint.merge="every_save"'],
     {"adapter": 3_303_505_920 * 2, "mcore_shards": 2_502_656_000 * 14, "rng_scheduler": RNG_8,
      "merged": 470_000_000_000}),
    (R235, [], {"mcore_shards": 2_502_656_000 * 14, "rng_scheduler": RNG_8}),
])
def test_per_save_bytes(path, overrides, parts):
    assert budget_of(path, *overrides).per_save_bytes == parts


FIELD = "checkpoint.save_steps=100"  # the field's interval (the shipped recipes choose it: "auto")


@pytest.mark.parametrize("path,overrides,keep,local_gib,persistent_gib,publish_mib_s", [
    # 397B checkpoint per save: adapter 30.44e9 B = 28.3 GiB + mcore_shards 156.30e9 B = 145.6 GiB -> 173.9 GiB;
    # every_save, 2 kept: 4 checkpoints (2 kept + 1 being written + 1 being published) + 2 merged copies (one
    # being written, one being published; a published merged copy is deleted locally): 4 x 173.9 + 2 x 739.5;
    # persistent: 4 copies (3 newest + best loss) of 913.4 GiB; 913.4 GiB per 1800 s = 519.6 MiB/s
    (R397, ['checkpoint.merge="every_save"', FIELD], 2, 2174.6, 3653.5, 519.6),
    # weights-only saves: adapter 28.3 GiB + merged 739.5 GiB every 30 min: 4 x 28.3 + 2 x 739.5; 4 x 767.8
    (R397, ['checkpoint.merge="every_save"', "checkpoint.keep_optimizer=false", FIELD], 2, 1592.3, 3071.3, 436.8),
    # final (with the HF adapter at every save): 2 kept + the 739.5 GiB export after the last step;
    # persistent: 4 copies + the merged model
    (R397, [ST, FIELD], 2, 1087.3, 1435.1, 98.9),
    (R397, [ST, "checkpoint.keep_local=1", FIELD], 1, 913.4, 1435.1, 98.9),
    (R397, ['checkpoint.merge="never"', FIELD], 2, 695.7, 695.7, 98.9),   # 4 x 173.9 GiB; 4 x 173.9 GiB
    (R397, [ST, "checkpoint.step_time_s=36", FIELD], 2, 1087.3, 1435.1, 49.5),  # a save per hour
    (R397, [ST, "checkpoint.save_steps=400"], 2, 1087.3, 1435.1, 24.7),
    # final as shipped: no HF adapter per save, 145.6 GiB: max(4 x 145.6, 2 x 145.6 + 739.5); 4 x 145.6 + 739.5;
    # a save every ~3 min (auto), the newest published every 30 min (publish_interval_s): 145.6 GiB / 1800 s
    (R397, [], 2, 1030.6, 1321.7, 82.8),
    (R397, ["checkpoint.keep_local=1"], 1, 885.0, 1321.7, 82.8),
    (R397, ["checkpoint.publish_interval_s=0"], 2, 1030.6, 1321.7, 828.1),  # every 3-min save published
    # 235B checkpoint per save: adapter 6.2 GiB + mcore_shards 32.6 GiB = 38.8 GiB; merged 437.7 GiB; 100
    # steps x 3.2 s (ms-swift's example) = 320 s, published at most every 1800 s
    (R235, ['checkpoint.merge="every_save"', FIELD], 2, 1030.6, 1906.0, 271.1),
    (R235, [ST, FIELD], 2, 515.3, 592.9, 22.1),
    (R235, [ST, FIELD, "checkpoint.publish_interval_s=0"], 2, 515.3, 592.9, 124.1),  # each save published
    (R235, [], 2, 503.0, 568.2, 18.6),                     # as shipped: 32.6 GiB per save
    (R235, [ST, "run.persistent_dir=\"\""], 3, 554.1, None, 0.0),  # no persistent_dir: 3 kept + the 437.7 GiB export
])
def test_budget(path, overrides, keep, local_gib, persistent_gib, publish_mib_s):
    b = budget_of(path, *overrides)
    assert b.keep_local == keep
    assert round(b.local_bytes / GIB, 1) == local_gib
    assert (None if b.persistent_bytes is None else round(b.persistent_bytes / GIB, 1)) == persistent_gib
    assert round(b.publish_bytes_per_s / MIB, 1) == publish_mib_s


def test_budget_merged_copy_bandwidth_is_the_issues_420():
    b = budget_of(R397, 'checkpoint.merge="every_save"', FIELD)
    assert round(b.per_save_bytes["merged"] / GIB) == 739 and b.save_interval_s == 1800
    assert round(b.per_save_bytes["merged"] / b.save_interval_s / MIB) == 421


@pytest.mark.parametrize("overrides,available_gib,keep,source", [
    ([], None, 2, "default"),                       # nothing measured: the cap (2 with a persistent_dir)
    ([], 5000, 2, "default"),
    ([], 1000, 1, "budget"),                        # 2 kept + export = 1087.3 GiB do not fit; 1 does (913.4)
    ([], 10, 1, "budget"),                          # never below 1: the disk check then fails instead
    (["checkpoint.keep_local=3"], 10, 3, "recipe"),  # the recipe's number is never lowered by the budget
    (["checkpoint.save_total_limit=2", "checkpoint.keep_local=5", "checkpoint.async_save=false"], None, 2, "recipe"),  # ms-swift's limit caps
])
def test_keep_local_default_from_the_budget(overrides, available_gib, keep, source):
    b = budget_of(R397, *overrides, available=None if available_gib is None else available_gib * GIB)
    assert (b.keep_local, b.keep_local_source) == (keep, source)


@pytest.mark.parametrize("path,overrides,step,source", [
    (R397, [], 18.0, "default for qwen3.5-397b-a17b"),
    (R235, [], 3.2, "default for qwen3-235b-a22b"),
    (R397, ["checkpoint.step_time_s=25"], 25.0, "checkpoint.step_time_s"),
    (R397, ['model.path="/models/SomethingElse"', "model.num_experts=512"], 10.0, "generic default"),
])
def test_step_time(path, overrides, step, source):
    b = budget_of(path, *overrides)
    assert b.step_time_s == step and b.step_time_source.startswith(source)


def test_unknown_model_budget_is_zero_with_a_note():
    r = R.load(R397, ['model.path="/models/SomethingElse"', "model.num_experts=512"])
    b = storage.budget(r, None)
    assert b.local_bytes == 4 * RNG_8 and "not estimated" in b.notes[0]  # only the RNG state is known


# --- disks: probe, held bytes, checks -------------------------------------------------------------

def test_probe_write_on_a_real_directory(tmp_path):
    speed, detail = host_probe.probe_write(str(tmp_path / "not" / "yet"), 8 * MIB)  # the nearest existing parent
    assert speed and speed > MIB and "8 MiB fsync'd" in detail and str(tmp_path) in detail
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_probe_write_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running as root: permissions do not stop writes")
        speed, detail = host_probe.probe_write(str(d), MIB)
        assert speed is None and "probe write failed" in detail
    finally:
        d.chmod(0o700)


def test_held_bytes_counts_checkpoints_only(tmp_path):
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "a.safetensors").write_bytes(os.urandom(3 * MIB))
    (tmp_path / "checkpoint-10-merged").mkdir()
    (tmp_path / "checkpoint-10-merged" / "m.safetensors").write_bytes(os.urandom(MIB))
    (tmp_path / "logging.jsonl").write_bytes(os.urandom(MIB))
    (tmp_path / "checkpoint-20").mkdir()  # a published copy hard-links unchanged files: counted once
    os.link(tmp_path / "checkpoint-10" / "a.safetensors", tmp_path / "checkpoint-20" / "a.safetensors")
    assert 4 * MIB <= host_probe.held_bytes(str(tmp_path)) < 5 * MIB
    assert host_probe.held_bytes(str(tmp_path / "absent")) == 0


def test_check_storage_messages(write_recipe):
    r = R.load(write_recipe(run={"persistent_dir": "pub"}, checkpoint={"merge": "every_save"}))
    b = storage.StorageBudget({"adapter": 10 * GIB, "merged": 100 * GIB}, 110 * GIB, 0, 2, "default",
                              420 * GIB, 440 * GIB, 18.0, "x", 1800.0, 1800.0, 0.0)
    disks = {"output_dir": {"path": r.run.output_dir, "free_bytes": 300 * GIB, "held_bytes": 20 * GIB},
             "persistent_dir": {"path": r.run.persistent_dir, "free_bytes": 500 * GIB, "held_bytes": 0}}
    out, pub = preflight.check_storage(r, b, disks)
    assert (out.name, out.ok, out.fatal) == ("disk:output_dir", False, True)
    for fragment in ("retention needs 420.0 GiB", "300.0 GiB free + 20.0 GiB in this run's checkpoints",
                     "lower checkpoint.keep_local (now 2)", 'checkpoint.merge = "final"', "1 being published",
                     f"(disk {host_probe.mount_point(r.run.output_dir)})"):
        assert fragment in out.detail, fragment
    assert (pub.name, pub.ok, pub.fatal) == ("disk:persistent_dir", True, True)


@pytest.mark.parametrize("speed,ok", [(None, False), (100 * MIB, False), (1000 * MIB, True)])
def test_check_publish_is_a_warning(speed, ok):
    r = R.load(R397, ['checkpoint.merge="every_save"', FIELD])
    c = preflight.check_publish(r, storage.budget(r, known_config(r.model.path)), speed, "probe failed")
    assert (c.name, c.ok, c.fatal) == ("publish_throughput", ok, False)
    assert "needs 520 MiB/s" in c.detail and ("raise checkpoint.publish_interval_s" in c.detail) is not ok


# --- a real small filesystem ---------------------------------------------------------------------

@pytest.fixture
def tmpfs(mount_tmpfs):
    """A 64 MiB tmpfs."""
    return mount_tmpfs("size=64m", "tmpfs")


def sized_recipe(write_recipe, tmp_path, out: Path, merge: str, merged_mib: int = 24) -> Path:
    """The tiny test model with an index saying 24 MiB of weights: a merged copy per save is 24 MiB."""
    model = make_model(tmp_path / "model", MODEL_CONFIG)
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": merged_mib * MIB}}))
    return write_recipe(run={"output_dir": str(out)}, checkpoint={"merge": merge}, gpu={"check": False},
                        supervisor={"min_free_gib": 0, "port_range": [29700, 29799]})


def test_fatal_check_on_a_small_filesystem(tmpfs, write_recipe, tmp_path):
    # every_save: 3 checkpoints + 2 merged copies of 24 MiB = 48+ MiB; default keep_local drops to 1 to fit
    # 1 kept + 1 being written (2 x 24 MiB + adapters) in 64 MiB
    r = R.load(sized_recipe(write_recipe, tmp_path, tmpfs / "out", "every_save"))
    b, disks = preflight.storage_budget(r)
    assert (b.keep_local, b.keep_local_source) == (1, "budget")
    assert by_name(preflight.check_storage(r, b, disks))["disk:output_dir"].ok
    # keep_local = 3 kept by the recipe cannot fit: 4 saves of 25.5 MiB (merged 24 MiB + adapter 80,896 x 2 B,
    # shards 62,464 x 14 B, RNG 8 x 64 KiB = 106,905,600 B / 4; no persistent_dir, so the merged copies stay
    # with their checkpoints)
    r = R.load(sized_recipe(write_recipe, tmp_path, tmpfs / "out", "every_save"), ["checkpoint.keep_local=3"])
    c = by_name(preflight.checks(r, plan.gpu.NullReader().snapshot()))["disk:output_dir"]
    assert (c.ok, c.fatal) == (False, True)
    assert f"(disk {tmpfs})" in c.detail and "retention needs 102.0 MiB" in c.detail and "64.0 MiB free" in c.detail
    assert "lower checkpoint.keep_local (now 3)" in c.detail and 'checkpoint.merge = "final"' in c.detail


def test_checkpoints_already_held_count_as_room(tmpfs, write_recipe, tmp_path):
    """A restarted run is not refused for the checkpoints retention will recycle."""
    out = tmpfs / "out"
    r = R.load(sized_recipe(write_recipe, tmp_path, out, "every_save"), ["checkpoint.keep_local=1"])
    (out / "checkpoint-4-merged").mkdir(parents=True)
    (out / "checkpoint-4-merged" / "model.safetensors").write_bytes(b"\1" * (40 * MIB))
    b, disks = preflight.storage_budget(r)
    assert disks["output_dir"]["free_bytes"] < b.local_bytes  # free alone would not do
    assert by_name(preflight.check_storage(r, b, disks))["disk:output_dir"].ok


def test_run_refuses_with_exit_2_when_storage_cannot_fit(tmpfs, write_recipe, tmp_path):
    path = sized_recipe(write_recipe, tmp_path, tmpfs / "out", "every_save")
    res = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(path), "--set", "checkpoint.keep_local=3",
                          "--set", "metrics.enabled=false"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "disk:output_dir" in res.stderr and "retention needs 102.0 MiB" in res.stderr
    assert not (tmpfs / "out" / ".orchestrator" / "attempts").exists() or \
        not any((tmpfs / "out" / ".orchestrator" / "attempts").iterdir())  # nothing launched


def test_plan_json_and_text_when_storage_cannot_fit(tmpfs, write_recipe, tmp_path):
    # with a persistent_dir, 2 merged copies of 40 MiB are local at most (one written, one published)
    path = sized_recipe(write_recipe, tmp_path, tmpfs / "out", "every_save", merged_mib=40)
    res = CliRunner().invoke(main, ["plan", str(path), "--json", "--set", "checkpoint.keep_local=3",
                                    "--set", f'run.persistent_dir="{tmp_path / "pub"}"'])
    p = json.loads(res.output)
    s = p["storage"]
    assert set(s["per_save_bytes"]) == {"adapter", "mcore_shards", "rng_scheduler", "merged"}
    assert s["per_save_bytes"]["merged"] == 40 * MIB
    assert all(isinstance(s[k], int) for k in ("local_bytes", "persistent_bytes"))
    assert isinstance(s["publish_bytes_per_s"], float) and s["publish_bytes_per_s"] > 0
    assert s["keep_local"] == 3 and s["disks"]["output_dir"]["write_bytes_per_s"] > 0  # probed by default
    assert s["disks"]["output_dir"]["seconds_per_save"] > 0
    checks = by_name(p["checks"])
    assert (checks["disk:output_dir"]["ok"], checks["disk:output_dir"]["fatal"]) == (False, True)
    assert checks["publish_throughput"]["fatal"] is False
    assert [e.name for e in tmpfs.joinpath("out").parent.iterdir()] == []  # the probe left nothing behind
    text = CliRunner().invoke(main, ["plan", str(path), "--no-probe", "--set", "checkpoint.keep_local=3"]).output
    assert "# storage per save" in text and "merged 40.0 MiB" in text and "not probed (--no-probe)" in text
    assert "[NOT OK] disk:output_dir" in text and "publish_throughput" not in text


def by_name(checks) -> dict:
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}
