"""`orchestrator import` on the shell a user meets (issue 33): a paste that lost its line continuations, bash arrays,
`$(nproc)` / `$(nvidia-smi -L | wc -l)` asked for with --var by name, `source env.sh` named as unread; every
refusal names the line, what was not understood and the next step, in one line."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.config.shell_script import commands
from orchestrator.ops.cli import main


def run(script: str, *args: str):
    return CliRunner().invoke(main, ["import", "-", "--json", *args], input=script, catch_exceptions=False)


def recipe(script: str, *args: str) -> dict:
    r = run(script, *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def refusal(script: str, *args: str) -> str:
    r = run(script, *args)
    lines = [x for x in r.stderr.splitlines() if x]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    return lines[0].removeprefix("orchestrator: error: -: ")


LOST = ("CUDA_VISIBLE_DEVICES=0 swift sft\n--model Qwen/Qwen2.5-7B-Instruct\n--train_type lora\n"
        "--dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' 'swift/self-cognition#500'\n--num_train_epochs 1\n"
        "--lora_rank 8\n--lora_alpha 32\n--output_dir output\n")


def test_a_paste_that_lost_its_continuations_is_one_command_with_a_note():
    report = recipe(LOST)
    rec = report["recipe"]
    assert rec["data"]["dataset"] == ["AI-ModelScope/alpaca-gpt4-data-zh#500", "swift/self-cognition#500"]
    assert (rec["lora"]["rank"], rec["lora"]["alpha"], rec["optim"]["epochs"]) == (8, 32, 1.0)
    assert any("lines 2-8 each start with `--`" in n and "lost its line continuations" in n for n in report["notes"])


def test_a_command_that_kept_some_continuations_is_still_refused_as_a_lost_backslash():
    text = "megatron sft --model m \\\n  --dataset d\n  --tuner_type lora \\\n  --train_iters 5\n"
    assert "line 3: `--tuner_type` starts a command of its own" in refusal(text)


@pytest.mark.parametrize("text, words", [
    ('DATASETS=(\n  "AI-ModelScope/alpaca-gpt4-data-zh#500"\n  "swift/self-cognition#500"  # who am I\n)\n'
     'swift sft --dataset "${DATASETS[@]}" --n ${#DATASETS[@]} --first ${DATASETS[0]}',
     ["swift", "sft", "--dataset", "AI-ModelScope/alpaca-gpt4-data-zh#500", "swift/self-cognition#500", "--n", "2",
      "--first", "AI-ModelScope/alpaca-gpt4-data-zh#500"]),
    ("GPUS=(0 1 2 3)\nswift sft --x ${GPUS[*]} --n ${#GPUS[@]}", ["swift", "sft", "--x", "0", "1", "2", "3", "--n", "4"]),
    ("A=(x)\nswift sft --a $A --b ${A[1]}", ["swift", "sft", "--a", "x", "--b"]),  # $A is the first element
])
def test_bash_arrays_set_in_the_script_are_read(text, words):
    assert list(commands(text)[-1].words) == words


def test_nproc_from_a_command_substitution_is_asked_for_by_name_and_var_gives_it():
    text = ("NPROC_PER_NODE=$(nvidia-smi -L | wc -l)\nexport NPROC_PER_NODE\n"
            "swift sft --model /m --dataset d --tuner_type lora\n")
    says = refusal(text)
    assert says.startswith("line 3: no value for $NPROC_PER_NODE") and "`$(nvidia-smi -L | wc -l)` at line 1" in says
    assert "--var NPROC_PER_NODE=" in says
    assert recipe(text, "--var", "NPROC_PER_NODE=4")["recipe"]["parallel"]["nproc_per_node"] == 4
    text = "GPUS=$(nproc)\nNPROC_PER_NODE=$GPUS swift sft --model /m --dataset d\n"
    assert "$GPUS is set from `$(nproc)` at line 1, which import does not run" in refusal(text)
    assert recipe(text, "--var", "GPUS=2")["recipe"]["parallel"]["nproc_per_node"] == 2


def test_a_substitution_only_in_the_log_file_name_is_not_asked_for():
    rec = recipe("swift sft --model /m --dataset d > logs/sft_$(date +%Y%m%d_%H%M).log 2>&1 &\n")["recipe"]
    assert rec["model"]["path"] == "/m"


def test_source_env_sh_is_named_as_unread_with_the_variables_it_would_set():
    text = "source ./env.sh\nswift sft --model $MODEL_PATH --dataset $DATA --tuner_type lora\n"
    says = refusal(text)
    assert "`source ./env.sh` at line 1 is not read, and may set $MODEL_PATH, $DATA" in says
    assert recipe(text, "--var", "MODEL_PATH=/m", "--var", "DATA=d")["recipe"]["data"]["dataset"] == ["d"]


@pytest.mark.parametrize("text, says", [
    ("swift sft --model /m --dataset d --system 'You are\n", "line 1: unclosed ' quote"),
    ("swift sft --model /m --dataset d --lora_rank $((16 /\n", "line 1: unclosed $(( ... ))"),
    ("n=\nswift sft --model /m --dataset d --gradient_accumulation_steps $(expr 16 / $n)\n",
     "line 2: the arithmetic uses $n, which is empty (so it reads '16 /'); set it to a number"),
    ("swift sft --model /m --dataset d --gradient_accumulation_steps $(expr 16 / $(nproc))\n",
     "line 1: the arithmetic '16 / $(nproc)' uses `$(nproc)`, which import does not run; replace it with its value"),
    ("swift sft --model /m --dataset d --lora_rank $((8 / 0))\n", "line 1: the arithmetic '8 / 0' divides by zero"),
    ("swift sft --model ${MODEL/-Instruct/} --dataset d\n", "line 1: `${MODEL/-Instruct/}` is a form of `${...}` import"
                                                           " does not read"),
    ("swift sft --model /m --dataset d --output_dir out/`date +%s`\n",
     "line 1: the command substitution `date +%s` is not run here; replace it with its value"),
    ("NPROC_PER_NODE= swift sft --model /m --dataset d\n", "line 1: NPROC_PER_NODE=: expected a whole number"),
])
def test_refusals_name_the_line_what_was_not_understood_and_the_next_step(text, says):
    assert refusal(text).startswith(says)
