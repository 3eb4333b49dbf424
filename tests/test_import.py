"""`orchestrator import`: ms-swift's own example scripts (tests/fixtures/ms-swift, pinned commit) and the field
command import, and round-trip: the imported recipe's `plan --json` argv and env carry every flag and variable
of the original command with the same value under its 4.x name, except those the report drops with a reason.
Commands it does not supervise, unresolved variables and cut-off pastes exit 2 saying what and where."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from recipes import ROOT

from orchestrator.config.command_form import find_training
from orchestrator.config.import_check import round_trip_problems
from orchestrator.config.importer import Imported
from orchestrator.config.shell_script import ScriptError, commands
from orchestrator.ops.cli import main

EXAMPLES = ROOT / "tests" / "fixtures" / "ms-swift" / "examples"
REFUSED = {"megatron/lora/dpo.sh": "`megatron rlhf` is RLHF", "train/rlhf/dpo/lora.sh": "`swift rlhf` is RLHF",
           "megatron/sft.sh": "trains all parameters",
           "train/multi-node/torchrun/train_node1.sh": "--tuner_type full: full-parameter training"}
LORA = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sh") if str(p.relative_to(EXAMPLES)) not in REFUSED)
FIELD = ROOT / "tests" / "fixtures" / "field" / "397b-command.sh"  # the field run's command (design notes)
FIELD_TEXT = FIELD.read_text()


def invoke(*args: str, stdin: str | None = None):
    return CliRunner().invoke(main, list(args), input=stdin, catch_exceptions=False)


def import_and_plan(script: Path, tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """(the import's --json report, the imported recipe's `plan --json`)."""
    out = tmp_path / "recipe.toml"
    r = invoke("import", str(script), "--output", str(out), "--json", *extra)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    p = invoke("plan", str(out), "--json", "--no-probe")
    assert p.exit_code in (0, 2), p.output  # 2: a pre-flight check (no GPU here); the command is printed either way
    return report, json.loads(p.stdout)


def assert_round_trip(text: str, report: dict, plan: dict, recipe_dir: Path, variables: dict | None = None) -> None:
    t, _ = find_training(commands(text, variables))
    imported = Imported(report["recipe"], report["mapped"], report["renamed"], report["dropped"])
    assert round_trip_problems(t, imported, plan["argv"], plan["env"], recipe_dir) == []
    for d in report["dropped"]:
        assert d["reason"] and d["flag"], d
    # every flag of the original is accounted for exactly once in the report
    accounted = [e["flag"] for e in report["mapped"] + report["renamed"] + report["dropped"]]
    for f in t.flags:
        assert f.written in accounted, f.written
    for name in t.env:
        assert name in accounted, name


@pytest.mark.parametrize("example", LORA)
def test_ms_swift_lora_examples_import_and_round_trip(example, tmp_path):
    script = EXAMPLES / example
    report, plan = import_and_plan(script, tmp_path)
    assert_round_trip(script.read_text(), report, plan, tmp_path)
    assert plan["backend"] == ("megatron" if example.startswith("megatron/") else "swift")
    assert "--tuner_type" in plan["argv"] and plan["argv"][plan["argv"].index("--tuner_type") + 1] == "lora"
    # the only flag these examples lose is the save interval, and sequence parallelism where ms-swift ignores it
    assert {d["flag"] for d in report["dropped"]} <= {"--save_steps", "--sequence_parallel"}


def test_the_examples_are_there_with_their_source():
    assert len(LORA) >= 12 and all((EXAMPLES / p).is_file() for p in REFUSED)
    assert "3602360a562313afbf2ef6065fdf61f271a2c5b9" in (EXAMPLES.parent / "README.md").read_text()


@pytest.mark.parametrize("example", sorted(REFUSED))
def test_commands_it_does_not_supervise_exit_2_saying_what(example):
    r = invoke("import", str(EXAMPLES / example))
    assert r.exit_code == 2
    assert REFUSED[example] in r.stderr and "Traceback" not in r.output


def test_the_field_command_imports_as_a_megatron_recipe(tmp_path):
    report, plan = import_and_plan(FIELD, tmp_path)
    assert_round_trip(FIELD_TEXT, report, plan, tmp_path)
    assert plan["backend"] == "megatron" and plan["argv"][:2] == ["megatron", "sft"]
    renamed = {e["flag"]: (e["to"], e["key"]) for e in report["renamed"]}
    assert renamed["--learning_rate"] == ("--lr", "optim.lr") and renamed["--train_type"][0] == "--tuner_type"
    assert renamed["--lora_target_modules"] == ("--target_modules", "lora.target_modules")
    dropped = {d["flag"]: d["reason"] for d in report["dropped"]}
    assert set(dropped) == {"--use_megatron", "--megatron_use_mcore", "--save_steps"}
    assert "megatron sft" in dropped["--use_megatron"]
    r = report["recipe"]
    assert (r["optim"]["lr"], r["checkpoint"]["keep_optimizer"], r["checkpoint"]["merge"]) == (2e-5, False, "every_save")
    assert r["env"]["vars"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"} and r["parallel"]["nproc_per_node"] == 8
    assert set(json.loads(invoke("import", str(FIELD), "--json").stdout)) >= {
        "recipe", "mapped", "renamed", "dropped", "unresolved"}


SCRIPT = """#!/bin/bash
# a comment
MODEL=/models/tiny   # a shell variable, not exported
export HF_HOME=/cache
nproc=2
NPROC_PER_NODE=$nproc MASTER_PORT=29600 NODE_RANK=0 \\
swift sft \\
    --model "$MODEL" --train_type lora \\
    --dataset ${DATA:-data/train.jsonl} 'hub/set#500' \\
    --learning_rate 2e-4 --gradient_accumulation_steps $(expr 8 / $nproc) \\
    --num_train_epochs 2 --output_dir $OUT --save_steps 50 \\
    --resume_from_checkpoint out/checkpoint-10 --add_version true \\
    --lr_scheduler_type cosine --system 'a b'   # trailing comment
swift infer --model "$MODEL"
"""


def test_a_script_with_variables_comments_and_owned_flags(tmp_path):
    (tmp_path / "s.sh").write_text(SCRIPT)
    r = invoke("import", str(tmp_path / "s.sh"), "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["unresolved"] == ["OUT"]
    assert "$OUT" in r.stderr and "--var" in r.stderr
    report, plan = import_and_plan(tmp_path / "s.sh", tmp_path, "--var", "OUT=/runs/x")
    assert_round_trip(SCRIPT, report, plan, tmp_path, {"OUT": "/runs/x"})
    rec = report["recipe"]
    assert rec["model"]["path"] == "/models/tiny" and rec["data"]["dataset"] == ["data/train.jsonl", "hub/set#500"]
    assert rec["optim"]["global_batch_size"] == 1 * 4 * 2 and rec["env"]["vars"] == {"HF_HOME": "/cache"}
    assert rec["extra_args"] == {"lr_scheduler_type": "cosine", "system": "a b"}
    dropped = {d["flag"]: d["reason"] for d in report["dropped"]}
    assert set(dropped) == {"MASTER_PORT", "NODE_RANK", "--save_steps", "--resume_from_checkpoint", "--add_version"}
    assert "resume" in dropped["--resume_from_checkpoint"] and "add_version false" in dropped["--add_version"]
    assert report["ignored"] == ["line 14: swift infer"]
    assert plan["env"]["NPROC_PER_NODE"] == "2" and plan["env"]["HF_HOME"] == "/cache"


@pytest.mark.parametrize("text, says", [
    ("megatron sft --model m --tuner_type lora --dataset 'a.jsonl", "line 1: unclosed ' quote"),
    ("megatron sft --model m \\\n  --tuner_type lora \\", "line 2: the script ends with a line continuation"),
    ("megatron sft --model m --tuner_type lora --dataset d --train_iters 5 --lora_ra", "looks cut off mid-flag"),
    ("megatron sft --model m --tuner_type lora --dataset d --train_iters 5 --lora_rank", "the command looks cut off"),
    ("megatron sft --model m --tuner_type lora --dataset d --train_iters 5 --lora_rank eight", "expected a whole number"),
    ("megatron sft --model m --tuner_type lora --dataset d --train_iters $(date +%s)", "is not run here"),
    ("megatron sft --model $M --tuner_type lora --dataset $D --train_iters 5", "no value for $M, $D"),
    ("swift infer --model m", "`swift infer` is inference"),
    ("python train.py --lr 1", "no `megatron sft` or `swift sft` command"),
    ("megatron sft cfg.yaml", "a config file"),
    ("swift sft --model m --dataset d --tuner_type full", "full-parameter training"),
    ("swift sft --model m --dataset d\nswift sft --model m --dataset e", "2 sft commands (lines 1, 2)"),
])
def test_bad_or_cut_off_input_exits_2_saying_what_and_where(text, says):
    r = invoke("import", "-", stdin=text)
    assert r.exit_code == 2, r.output
    assert says in r.stderr and "Traceback" not in r.output


def test_stdin_prints_the_recipe_and_an_existing_output_is_kept(tmp_path):
    text = "CUDA_VISIBLE_DEVICES=0 swift sft --model /m --dataset d.jsonl --max_steps 10 --lora_rank 4\n"
    r = invoke("import", "-", stdin=text)
    assert r.exit_code == 0 and "[lora]\nrank = 4" in r.stdout and "not carried over" in r.stderr
    (tmp_path / "r.toml").write_text("mine")
    r = invoke("import", "-", "--output", str(tmp_path / "r.toml"), stdin=text)
    assert r.exit_code == 2 and (tmp_path / "r.toml").read_text() == "mine"
    r = invoke("import", "-", "--output", str(tmp_path / "r.toml"), "--force", stdin=text)
    assert r.exit_code == 0 and "rank = 4" in (tmp_path / "r.toml").read_text()


def test_an_invalid_result_names_the_flags_it_came_from():
    r = invoke("import", "-", stdin="NPROC_PER_NODE=8 megatron sft --model /m --dataset d --tuner_type lora "
                                    "--train_iters 5 --global_batch_size 12\n")
    assert r.exit_code == 2 and "optim.global_batch_size" in r.stderr and "--global_batch_size 12" in r.stderr


@pytest.mark.parametrize("script, words, env", [
    ("A=1\nexport B=$A\nC=x$A swift sft --x \"$B\" '$B' \\$B", ["swift", "sft", "--x", "1", "$B", "$B"], {"B": "1", "C": "x1"}),
    ("swift sft --d a#b 'c#d' # e f", ["swift", "sft", "--d", "a#b", "c#d"], {}),
    ("V='p q'\nswift sft --v $V \"$V\"", ["swift", "sft", "--v", "p", "q", "p q"], {}),
    ("swift sft --n $((2*3+1)) ${U:-u} ${E-} | tee log", ["swift", "sft", "--n", "7", "u"], {}),
    ("nohup swift sft --x 1 > out.log 2>&1 &", ["swift", "sft", "--x", "1"], {}),  # the launch: test_import_wrappers
])
def test_shell_words_as_the_shell_reads_them(script, words, env):
    cmd = commands(script)[0]  # the first command (a pipe's `tee` is the next one)
    assert list(cmd.words) == words and cmd.env == env and cmd.unresolved == ()


def test_unreadable_scripts_raise_with_the_line():
    with pytest.raises(ScriptError, match="line 2: unclosed"):
        commands("echo ok\nswift sft --x \"y\n\n")
    assert commands("echo $HOME")[0].unresolved == ("HOME",)
    assert commands("swift sft --x $X", {"X": "given"})[0].words[-1] == "given"


@pytest.mark.parametrize("values, kind, expected", [
    (("8",), int, 8), (("-1",), int, -1), (("1e-4",), float, 1e-4), (("2",), float, 2.0), ((), bool, True),
    (("True",), bool, True), (("false",), bool, False), (("a", "b"), list, ["a", "b"]), (("x y",), str, "x y"),
])
def test_convert_reads_words_as_the_recipe_keys_type(values, kind, expected):
    from orchestrator.config.importer import convert

    got = convert(values, kind)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("values, kind", [(("8.5",), int), (("eight",), int), (("nan",), float), (("1_0",), float),
                                          (("maybe",), bool), ((), int), (("1", "2"), float), ((), list)])
def test_convert_refuses_what_is_not_that_type(values, kind):
    from orchestrator.config.importer import convert

    with pytest.raises(ValueError, match="expected"):
        convert(values, kind)


@pytest.mark.parametrize("values, expected", [
    ((), True), (("true",), True), (("False",), False), (("3",), 3), (("1e-3",), 1e-3), (("0.5",), 0.5),
    # false-positive rows: words that look like numbers but would not render back as written stay strings
    (("007",), "007"), (("+3",), "+3"), (("inf",), "inf"), (("1_000",), "1_000"), (("v1.2",), "v1.2"),
    (("a", "b"), ["a", "b"]), (("",), ""),
])
def test_extra_args_values_keep_what_was_written(values, expected):
    from orchestrator.config.importer import extra_value

    got = extra_value(values)
    assert got == expected and type(got) is type(expected)


def test_megatron_accumulation_becomes_the_global_batch_and_other_forms_are_read(tmp_path):
    text = ("NPROC_PER_NODE=4 megatron sft --model /m --dataset d --tuner_type lora --train_iters 5 "
            "--micro_batch_size 2 --gradient_accumulation_steps 3 --tensor_model_parallel_size 2\n")
    r = invoke("import", "-", "--json", stdin=text)
    report = json.loads(r.stdout)
    assert report["recipe"]["optim"]["global_batch_size"] == 2 * 3 * 2  # micro x accumulation x data-parallel
    (d,) = report["dropped"]
    assert d["flag"] == "--gradient_accumulation_steps" and "= 12" in d["reason"]
    for form in ("python -m swift.cli.main sft", "python3 swift/cli/sft.py", "torchrun --nproc_per_node=2 swift/cli/sft.py"):
        r = invoke("import", "-", "--json", stdin=f"{form} --model /m --dataset d --max_steps 3\n")
        assert r.exit_code == 0, (form, r.output)
        assert json.loads(r.stdout)["recipe"]["run"]["backend"] == "swift"
    r = invoke("import", "-", "--json", stdin="torchrun --nproc_per_node=2 swift/cli/sft.py --model /m --dataset d --max_steps 3")
    assert json.loads(r.stdout)["recipe"]["parallel"]["nproc_per_node"] == 2


def test_an_exported_variable_built_from_an_unset_one_is_unresolved():
    (cmd,) = commands("export OUT=$BASE/x\nswift sft --model /m")
    assert cmd.unresolved == ("BASE",) and cmd.env == {"OUT": "/x"}
    assert commands("export OUT=$BASE/x\nswift sft --model /m", {"BASE": "/b"})[0].env == {"OUT": "/b/x"}
