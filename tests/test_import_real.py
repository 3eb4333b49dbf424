"""`orchestrator import` on real commands users pasted in public GitHub threads (tests/fixtures/commands, see its
README): every tune-split command gets its expected outcome (a recipe with the facts sources.jsonl lists, or one
refusal naming the cause, exit 2, nothing written), the held-out split stays at or above its measured figure, and
the paste forms those commands showed are read as the shell would read what they wrap."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner
from recipes import ROOT

from orchestrator.config.paste import unwrap
from orchestrator.config.shell_script import ScriptError, commands
from orchestrator.ops.cli import main

_SPEC = importlib.util.spec_from_file_location("measure", ROOT / "tests" / "fixtures" / "commands" / "measure.py")
assert _SPEC is not None and _SPEC.loader is not None
measure = importlib.util.module_from_spec(_SPEC)
sys.modules["measure"] = measure  # dataclasses look their module up there
_SPEC.loader.exec_module(measure)

ENTRIES = measure.entries()
TUNE = [e for e in ENTRIES if e["split"] == "tune"]
HELDOUT_FLOOR = 14  # right of 14 (13 first-set + 1 added); 12 the clean first-set figure (fixtures README)
FIRST_SET = 42  # entries split by rank of sha256(source); those after it by the hash alone, so none ever moves


def test_the_set_is_there_and_split_by_source():
    assert len(ENTRIES) >= 35 and len({e["file"] for e in ENTRIES}) == len(ENTRIES)
    assert sum(e["split"] == "heldout" for e in ENTRIES[:FIRST_SET]) == round(0.3 * FIRST_SET)
    for e in ENTRIES[FIRST_SET:]:
        held = int(hashlib.sha256(e["source"].encode()).hexdigest()[:8], 16) < 0.3 * 2**32
        assert e["split"] == ("heldout" if held else "tune"), e["file"]
    for e in ENTRIES:
        assert (measure.HERE / e["file"]).is_file() and e["source"].startswith("https://github.com/")
        assert e["expect"] in ("recipe", "refused") and (e["facts"] if e["expect"] == "recipe" else e["why"])


@pytest.mark.parametrize("entry", TUNE, ids=[e["file"] for e in TUNE])
def test_each_tune_command_gets_its_expected_outcome(entry):
    outcome = measure.score(entry)
    assert outcome.ok, outcome.why


def test_the_held_out_commands_stay_at_their_measured_figure():
    held = [measure.score(e) for e in ENTRIES if e["split"] == "heldout"]
    assert sum(o.ok for o in held) >= HELDOUT_FLOOR


@pytest.mark.parametrize("text, words", [
    ("```bash\nswift sft --model m \\\n  --x 1 \\\n```\n", ["swift", "sft", "--model", "m", "--x", "1"]),
    ("```export A=1\nswift sft --x $A\n```", ["swift", "sft", "--x", "1"]),
    ("`swift sft --x 1 2>&1 | tee log`", ["swift", "sft", "--x", "1"]),
    ("swift sft \\\r\n  --x 1\r\n", ["swift", "sft", "--x", "1"]),
    ("$ swift sft --x 1", ["swift", "sft", "--x", "1"]),
    ("(swift) me@gpu-01:~/ms-swift$ NPROC_PER_NODE=8 megatron sft \\\n  --x 1", ["megatron", "sft", "--x", "1"]),
    ("swift sft --x $ --y 1", ["swift", "sft", "--x", "$", "--y", "1"]),   # a '$ ' inside a line is no prompt
])
def test_pasted_markdown_and_windows_line_endings_are_unwrapped(text, words):
    assert list(commands(unwrap(text))[-1 if text.startswith("```export") else 0].words) == words


def test_an_unclosed_fence_is_a_cut_off_paste_and_keeps_line_numbers():
    with pytest.raises(ScriptError, match="line 2: the ``` code fence opened here is never closed"):
        unwrap("echo\n```sh\nmegatron sft --model m \\\n  --lora_rank 8")
    assert commands(unwrap("```\n\nswift sft --x 1\n```"))[0].line == 3


def test_a_prefix_before_export_lives_only_for_export():
    (cmd,) = commands("A=1 B=2 export C=3 \\\n\nswift sft --x $A")
    assert cmd.env == {"C": "3"} and cmd.unresolved == ("A",)


@pytest.mark.parametrize("text, says", [
    ("swift sft \\  --model m \\  --dataset d", "a `\\` followed by a space"),
    ("megatron sft --model m \\\n  --dataset d\n  --tuner_type lora \\\n  --train_iters 5", "line 3: `--tuner_type` starts"),
    ("uv run --python 3.11 torchrun --nproc_per_node 2 swift/cli/rlhf.py --rlhf_type dpo", "`swift rlhf` is RLHF"),
    ("swift infer --model m \\\n", "`swift infer` is inference"),
    ("swift sft --model m --dataset d --sft_type full", "--sft_type full: full-parameter training"),
])
def test_broken_pastes_are_refused_with_one_message_naming_the_cause(text, says):
    r = CliRunner().invoke(main, ["import", "-"], input=text, catch_exceptions=False)
    assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ms_swift_2x_names_and_an_unlimited_save_total_limit_are_read(tmp_path):
    text = ("swift sft --model_id_or_path /m --sft_type lora --custom_train_dataset_path d.jsonl "
            "--lora_dropout_p 0.1 --max_steps 3 --save_total_limit -1 --evaluation_strategy steps\n")
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    rec = report["recipe"]
    assert (rec["model"]["path"], rec["data"]["dataset"], rec["lora"]["dropout"]) == ("/m", ["d.jsonl"], 0.1)
    assert {e["flag"]: e["to"] for e in report["renamed"]}["--evaluation_strategy"] == "--eval_strategy"
    assert "checkpoint" not in rec or "save_total_limit" not in rec["checkpoint"]
    assert any(d["flag"] == "--save_total_limit" for d in report["dropped"])


@pytest.mark.parametrize("text, says", [
    ("swift sft --model m --dataset d --gradient_accumulation_steps $(expr 16 / $nproc_per_node)", "$nproc_per_node"),
    ("swift sft --model m --dataset d --gradient_accumulation_steps $((16 / n))", "$n, which has no value"),
])
def test_arithmetic_on_an_unset_variable_names_the_variable(text, says):
    r = CliRunner().invoke(main, ["import", "-"], input=text, catch_exceptions=False)
    assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_3x_load_without_model_becomes_the_model_path_and_mcore_model():
    text = ("NNODES=2 NPROC_PER_NODE=8 megatron sft --load /ckpt/GLM-mcore --dataset d --train_type lora "
            "--tensor_model_parallel_size 4 --pipeline_model_parallel_size 2 --context_parallel_size 2 "
            "--sequence_parallel true --global_batch_size 4 --train_iters 5\n")
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)["recipe"]
    assert rec["model"]["path"] == rec["extra_args"]["mcore_model"] == "/ckpt/GLM-mcore"
    assert (rec["parallel"]["nnodes"], rec["parallel"]["context"]) == (2, 2)  # 16 ranks span both nodes


def test_2x_batch_and_template_names_and_an_empty_cuda_visible_devices():
    text = "CUDA_VISIBLE_DEVICES= swift sft --model m --dataset d --sft_type lora --batch_size 2 --template_type qwen\n"
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert (report["recipe"]["optim"]["micro_batch_size"], report["recipe"]["model"]["template"]) == (2, "qwen")
    assert "CUDA_VISIBLE_DEVICES" not in report["recipe"].get("env", {}).get("vars", {})
    assert any(d["flag"] == "CUDA_VISIBLE_DEVICES" for d in report["dropped"])
