"""`orchestrator import` on ms-swift's own example scripts from older releases (tests/fixtures/ms-swift-old, see
its README): v2.6.1, v3.5.3, v3.9.3 and v3.12.6, the scripts users copy. Every tune-split script gets its
expected outcome (a recipe carrying the facts sources.jsonl lists, or one refusal naming the cause, exit 2,
nothing written), the held-out split stays at or above its measured figure, and the 2.x / 3.x forms those
scripts showed are read as ms-swift 4 needs them."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner
from recipes import ROOT

from orchestrator.ops.cli import main

_SPEC = importlib.util.spec_from_file_location("old_measure", ROOT / "tests" / "fixtures" / "ms-swift-old" / "measure.py")
assert _SPEC is not None and _SPEC.loader is not None
measure = importlib.util.module_from_spec(_SPEC)
sys.modules["old_measure"] = measure  # dataclasses look their module up there
_SPEC.loader.exec_module(measure)

ENTRIES = measure.entries()
TUNE = [e for e in ENTRIES if e["split"] == "tune"]
HELDOUT_FLOOR = 20  # right of 20 after the changes (16 before; see the fixtures README)
COMMITS = {"v2.6.1": "ab38bff0387a86fd9f068246c326ee7b0d5ed139", "v3.5.3": "87dba55a7443c8e28d4ba376f611800dfdb5047b",
           "v3.9.3": "aa368293005c49eac8df21e31c82b9dc501f19ba", "v3.12.6": "8773ecd08ef075a3c9b889ca967cd94e9c308fbd"}


def test_the_set_is_there_and_split_by_tag_and_path():
    assert 40 <= len(ENTRIES) <= 70 and len({e["file"] for e in ENTRIES}) == len(ENTRIES)
    for e in ENTRIES:
        assert e["file"] == f"{e['tag']}/{e['path']}" and (measure.HERE / e["file"]).is_file()
        assert e["commit"] == COMMITS[e["tag"]] and e["expect"] in ("recipe", "refused")
        assert e["facts"] if e["expect"] == "recipe" else (e["why"] and e["says"])
        held = int(hashlib.sha256(f"{e['tag']}:{e['path']}".encode()).hexdigest()[:8], 16) < 0.3 * 2**32
        assert e["split"] == ("heldout" if held else "tune"), e["file"]


@pytest.mark.parametrize("entry", TUNE, ids=[e["file"] for e in TUNE])
def test_each_tune_script_gets_its_expected_outcome(entry):
    outcome = measure.score(entry)
    assert outcome.ok, outcome.why


def test_the_held_out_scripts_stay_at_their_measured_figure():
    held = [measure.score(e) for e in ENTRIES if e["split"] == "heldout"]
    assert sum(o.ok for o in held) >= HELDOUT_FLOOR


def _imported(text: str) -> dict:
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _refused(text: str) -> str:
    r = CliRunner().invoke(main, ["import", "-"], input=text, catch_exceptions=False)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    return r.stderr


def test_2x_value_spellings_become_their_4x_ones():
    report = _imported("swift sft --model_id_or_path /m --sft_type lora --dataset d.jsonl --dtype bf16 "
                       "--deepspeed default-zero3 --lora_target_modules ALL EMBEDDING --quantization_bit 4 "
                       "--use_flash_attn true --bnb_4bit_comp_dtype fp16 --preprocess_num_proc 4\n")
    rec = report["recipe"]
    assert rec["model"]["torch_dtype"] == "bfloat16" and rec["lora"]["target_modules"] == ["all-linear", "all-embedding"]
    assert rec["extra_args"] == {"deepspeed": "zero3", "quant_bits": 4, "quant_method": "bnb", "attn_impl": "flash_attn",
                                 "bnb_4bit_compute_dtype": "float16"}
    assert rec["data"]["dataset_num_proc"] == 4 and any("default-zero3" in n for n in report["notes"])


def test_2x_auto_and_default_values_are_dropped_saying_what_ms_swift_4_does_instead():
    report = _imported("swift sft --model_id_or_path /m --dataset d --dtype AUTO --template_type AUTO "
                       "--lora_target_modules DEFAULT --quantization_bit 0 --use_flash_attn false\n")
    dropped = {d["flag"]: d["reason"] for d in report["dropped"]}
    assert {"--dtype", "--template_type", "--lora_target_modules", "--quantization_bit", "--use_flash_attn"} <= set(dropped)
    assert "all-linear" in dropped["--lora_target_modules"] and "template" in dropped["--template_type"]
    assert "target_modules" not in report["recipe"].get("lora", {})


@pytest.mark.parametrize("flags, dataset, folded", [
    ("--dataset a --train_dataset_sample 500", ["a#500"], True),
    ("--dataset 'a#200' --train_dataset_sample 500", ["a#200"], True),  # 2.x kept the smaller count
    ("--dataset a b --train_dataset_sample 500", ["a", "b"], False),  # 2.x ignored it with several datasets
    ("--self_cognition_sample 300 --dataset a self-cognition", ["a", "swift/self-cognition#300"], True),
    ("--dataset a --train_dataset_sample -1", ["a"], False),
])
def test_2x_sample_counts_become_dataset_counts(flags, dataset, folded):
    report = _imported(f"swift sft --model /m --sft_type lora {flags}\n")
    assert report["recipe"]["data"]["dataset"] == dataset
    reasons = [d["reason"] for d in report["dropped"] if d["flag"].endswith("_sample")]
    assert len(reasons) == 1 and (("--dataset" in reasons[0]) if folded else True)


def test_3x_megatron_no_switches_become_4x_switches_with_the_opposite_value():
    report = _imported("megatron sft --model /m --dataset d --train_type lora --train_iters 5 "
                       "--no_gradient_accumulation_fusion true --no_rope_fusion --use_flash_attn true\n")
    extra = report["recipe"]["extra_args"]
    assert extra["gradient_accumulation_fusion"] is False and extra["apply_rope_fusion"] is False
    assert extra["attention_backend"] == "flash"


def test_deepspeeds_launcher_runs_the_sft_script_and_its_hostfile_is_named_as_not_read():
    report = _imported("deepspeed --num_gpus 4 --hostfile=./host.txt --master_port 29600 swift/cli/sft.py "
                       "--model /m --train_type lora --dataset d\n")
    assert report["recipe"]["run"]["backend"] == "swift" and report["recipe"]["parallel"]["nproc_per_node"] == 4
    dropped = {d["flag"]: d["reason"] for d in report["dropped"]}
    assert "hosts" in dropped["deepspeed --hostfile"] and "deepspeed --master_port" in dropped


def test_an_accelerate_config_file_is_named_as_not_read_and_the_process_count_noted():
    report = _imported("accelerate launch --config_file fsdp.json swift/cli/sft.py --model /m --dataset d\n")
    reason = next(d["reason"] for d in report["dropped"] if d["flag"] == "accelerate launch --config_file")
    assert "not read" in reason and "parallel.nproc_per_node" in reason
    assert any("`accelerate launch` gave no process count" in n for n in report["notes"])


def test_2x_llm_entry_points_are_sft_and_inference():
    report = _imported("PYTHONPATH=../../.. CUDA_VISIBLE_DEVICES=0 python llm_sft.py --model_id_or_path /m "
                       "--sft_type lora --dataset d\n")
    assert report["recipe"]["run"]["backend"] == "swift" and report["recipe"]["model"]["path"] == "/m"
    assert any(d["flag"] == "PYTHONPATH" and "relative" in d["reason"] for d in report["dropped"])
    assert "inference" in _refused("python llm_infer.py --ckpt_dir out/ckpt\n")
    assert "RLHF (2.x `dpo`" in _refused("swift dpo --model_type yi-6b-chat --sft_type lora\n")


def test_a_last_line_ending_in_a_continuation_before_the_final_newline_ends_the_command():
    report = _imported("swift sft \\\n  --model /m \\\n  --dataset d \\\n")
    assert report["recipe"]["data"]["dataset"] == ["d"]
    assert "looks cut off" in _refused("swift sft \\\n  --model /m \\\n  --dataset d \\")


def test_an_absolute_pythonpath_is_carried():
    report = _imported("PYTHONPATH=/opt/lib swift sft --model /m --dataset d\n")
    assert report["recipe"]["env"]["vars"]["PYTHONPATH"] == "/opt/lib"


def test_a_powershell_script_is_refused_as_powershell():
    says = _refused('$env:CUDA_VISIBLE_DEVICES="0"\npython llm_sft.py `\n    --model_id_or_path m `\n    --sft_type lora\n')
    assert "line 1: a PowerShell script" in says


def test_a_relative_3x_load_is_read_beside_the_recipe_like_model_path(tmp_path):
    from orchestrator.config import recipe as R

    text = "NPROC_PER_NODE=2 megatron sft --load Qwen-mcore --dataset d --train_type lora --max_epochs 1\n"
    r = CliRunner().invoke(main, ["import", "-", "--output", str(tmp_path / "r.toml")], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec = R.load(tmp_path / "r.toml")
    assert rec.extra_args["mcore_model"] == rec.model.path == str(tmp_path / "Qwen-mcore")
