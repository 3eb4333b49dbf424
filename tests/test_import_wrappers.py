"""`orchestrator import` reads through what people put around a training command to start it from a shell (issue
33): wrappers wherever they stand (after env prefixes and `\\`), each with its options, and the log redirections,
pipes and `&` after it; each is listed in the report's `dropped` with what the orchestrator does instead. The
scripts are written as users write them (the issue's `CUDA_VISIBLE_DEVICES=0 \\` + `nohup swift sft \\` ...
`> train.log 2>&1 &`, the commonest way to start a multi-day run from a shell)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.config.launch_wrappers import LOGS, read_launch, why_dropped
from orchestrator.ops.cli import main

SFT = "swift sft \\\n    --model /models/Qwen2.5-7B-Instruct \\\n    --dataset data/train.jsonl \\\n    --tuner_type lora"


def imported(script: str) -> dict:
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=script, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def dropped(report: dict) -> dict[str, str]:
    return {d["flag"]: d["reason"] for d in report["dropped"]}


@pytest.mark.parametrize("script, env, listed", [
    (f"CUDA_VISIBLE_DEVICES=0 \\\nnohup {SFT} \\\n    > train.log 2>&1 &\n", {"CUDA_VISIBLE_DEVICES": "0"},
     ["nohup", "> train.log", "2>&1", "&"]),
    (f"export CUDA_VISIBLE_DEVICES=0,1\nNPROC_PER_NODE=2 nohup {SFT} > logs/sft_$(date +%F).log 2>&1 &\n",
     {"CUDA_VISIBLE_DEVICES": "0,1"}, ["nohup", "&"]),
    (f"CUDA_VISIBLE_DEVICES=0 setsid nohup nice -n 10 {SFT} \\\n    2>&1 | tee -a train.log\n",
     {"CUDA_VISIBLE_DEVICES": "0"}, ["setsid", "nohup", "nice -n 10", "2>&1", "| tee -a train.log"]),
    (f"ionice -c2 -n7 stdbuf -oL env WANDB_MODE=offline HF_HUB_OFFLINE=1 {SFT} | tee train.log\n",
     {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}, ["ionice -c2 -n7", "stdbuf -oL", "env", "| tee train.log"]),
    (f"time CUDA_VISIBLE_DEVICES=3 {SFT}\n", {"CUDA_VISIBLE_DEVICES": "3"}, ["time"]),
    (f"#!/bin/bash\nset -e\nexec {SFT} >> /var/log/sft.log 2>&1\n", {}, ["exec", ">> /var/log/sft.log", "2>&1"]),
])
def test_wrappers_after_env_prefixes_and_continuations_are_read_through(script, env, listed):
    report = imported(script)
    assert {k: v for k, v in report["recipe"].get("env", {}).get("vars", {}).items()} == env
    said = dropped(report)
    for item in listed:
        assert item in said, (item, said)
    assert report["recipe"]["model"]["path"] == "/models/Qwen2.5-7B-Instruct"


def test_the_log_redirection_says_where_the_orchestrator_keeps_its_logs():
    said = dropped(imported(f"nohup {SFT} > train.log 2>&1 &\n"))
    assert LOGS in said["> train.log"] and LOGS in said["nohup"] and LOGS in said["&"]
    assert LOGS == "<run.output_dir>/.orchestrator/attempts/attempt-NNNN.log"  # store/rundir.py's layout


@pytest.mark.parametrize("script, launcher, says", [
    ("srun --nodes=2 --ntasks-per-node=1 --gres=gpu:8 \\\n  torchrun --nproc_per_node 8 --nnodes 2 swift/cli/sft.py "
     "--model /m --dataset d --tuner_type lora\n", "srun --nodes=2 --ntasks-per-node=1 --gres=gpu:8",
     "orchestrator sbatch RECIPE"),
    ("mpirun -np 8 --allow-run-as-root -x NCCL_DEBUG=INFO swift sft --model /m --dataset d --tuner_type lora\n",
     "mpirun -np 8 --allow-run-as-root -x NCCL_DEBUG=INFO", "parallel.nproc_per_node"),
])
def test_srun_and_mpirun_in_front_say_what_the_orchestrator_does_instead(script, launcher, says):
    report = imported(script)
    assert says in dropped(report)[launcher]
    if "mpirun" in launcher:
        assert report["recipe"]["env"]["vars"]["NCCL_DEBUG"] == "INFO"  # -x NAME=value reaches the processes
    else:
        assert report["recipe"]["parallel"]["nnodes"] == 2


@pytest.mark.parametrize("words, command, wrappers, redirections", [
    ("nohup python -u x.py", ["python", "-u", "x.py"], ["nohup"], []),
    ("nice -10 swift sft", ["swift", "sft"], ["nice -10"], []),
    ("nice --adjustment=5 swift", ["swift"], ["nice --adjustment=5"], []),
    ("taskset -c 0-7 numactl --interleave=all swift", ["swift"], ["taskset -c 0-7", "numactl --interleave=all"], []),
    ("timeout -s INT 72h swift", ["swift"], ["timeout -s INT 72h"], []),
    ("/usr/bin/nohup swift 1>out 2> err", ["swift"], ["/usr/bin/nohup"], ["1>out", "2> err"]),
    ("mpirun -mca btl ^openib -np 4 swift", ["swift"], ["mpirun -mca btl ^openib -np 4"], []),
    ("swift sft --x 1", ["swift", "sft", "--x", "1"], [], []),        # nothing around it: nothing taken
    ("nohupx swift", ["nohupx", "swift"], [], []),                     # only whole names are wrappers
])
def test_read_launch_takes_each_wrapper_with_its_options(words, command, wrappers, redirections):
    got = read_launch(words.split())
    assert (list(got.words), list(got.wrappers), list(got.redirections)) == (command, wrappers, redirections)


def test_every_wrapper_has_a_reason_that_names_what_to_do():
    for item in ("nohup", "setsid", "&", "> log", "2>&1", "| tee log", "env", "exec", "time", "timeout 3h", "srun -N 2",
                 "mpirun -np 8"):
        assert len(why_dropped(item)) > 40, item
    assert 'run.entrypoint = ["nice", "-n", "10", "swift"]' in why_dropped("nice -n 10")
