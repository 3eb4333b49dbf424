"""`orchestrator import`'s rules for what the rendered command leaves out on purpose: a process or node count of 1
(`export NPROC_PER_NODE=1` before a one-process `swift sft`, `NNODES=1`) is carried as parallel.* and said in the
report, never a traceback; and the import's own self-check refuses (exit 2) rather than raise."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.config.import_check import count_carried
from orchestrator.config.import_env import unset_count
from orchestrator.ops.cli import main


@pytest.mark.parametrize("name, value, env, carried", [
    ("NPROC_PER_NODE", "1", {}, True),                     # one process: the renderer sets nothing
    ("NNODES", "1", {}, True),
    ("NPROC_PER_NODE", "01", {"NPROC_PER_NODE": "1"}, True),  # by number, as ms-swift reads it
    ("NPROC_PER_NODE", "2", {}, False),                    # two processes and nothing set: lost
    ("NPROC_PER_NODE", "2", {"NPROC_PER_NODE": "4"}, False),
    ("NPROC_PER_NODE", "8", {"NPROC_PER_NODE": "8"}, True),
    ("NNODES", "2", {}, False),
    ("NNODES", "x", {}, False),
])
def test_a_count_is_carried_by_number_and_absent_means_one(name, value, env, carried):
    assert count_carried(name, value, env) is carried


@pytest.mark.parametrize("name, backend, parallel, unset", [
    ("NPROC_PER_NODE", "swift", {"nproc_per_node": 1}, True),
    ("NPROC_PER_NODE", "swift", {"nproc_per_node": 1, "nnodes": 2}, False),  # several nodes: torchrun, set
    ("NPROC_PER_NODE", "swift", {"nproc_per_node": 2}, False),
    ("NPROC_PER_NODE", "megatron", {"nproc_per_node": 1}, False),  # megatron always gets it
    ("NNODES", "swift", {"nnodes": 1}, True),
    ("NNODES", "megatron", {"nnodes": 1}, True),
    ("NNODES", "megatron", {"nnodes": 2}, False),
])
def test_the_report_says_when_a_count_of_one_is_not_set_at_launch(name, backend, parallel, unset):
    assert (unset_count(name, backend, parallel) is not None) is unset


@pytest.mark.parametrize("script, notes", [
    ("export NPROC_PER_NODE=1\nexport NNODES=1\nCUDA_VISIBLE_DEVICES=0 swift sft --model /m --dataset d "
     "--tuner_type lora\n", ["NPROC_PER_NODE=1 -> parallel.nproc_per_node = 1: one process",
                             "NNODES=1 -> parallel.nnodes = 1: one node"]),
    ("NPROC_PER_NODE=1 NNODES=2 swift sft --model /m --dataset d\n", []),  # two nodes: both rendered
    ("NNODES=1 NPROC_PER_NODE=1 megatron sft --model /m --dataset d --tuner_type lora --train_iters 3\n",
     ["NNODES=1 -> parallel.nnodes = 1: one node"]),
])
def test_nproc_per_node_1_before_a_one_process_swift_sft_imports_and_says_so(script, notes):
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=script, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    said = [n for n in report["notes"] if n.startswith(("NPROC_PER_NODE=", "NNODES="))]
    assert [n for n in said for want in notes if n.startswith(want)] == said and len(said) == len(notes), said
    mapped = {e["flag"]: e["key"] for e in report["mapped"]}
    assert mapped.get("NPROC_PER_NODE") == "parallel.nproc_per_node"


def test_the_self_check_refuses_with_one_line_instead_of_a_traceback(monkeypatch):
    import orchestrator.ops.importer as importer
    monkeypatch.setattr(importer, "round_trip_problems", lambda *a: ["--lora_rank 8: rendered as nothing"])
    r = CliRunner().invoke(main, ["import", "-"], input="swift sft --model /m --dataset d --lora_rank 8\n",
                           catch_exceptions=False)
    assert r.exit_code == 2 and r.stderr.count("orchestrator: error:") == 1, r.output
    assert "line 1: the recipe would not carry --lora_rank 8" in r.stderr and "please report it" in r.stderr


def test_an_offload_fraction_without_the_offload_is_dropped_as_a_no_op():
    # found by the fuzz test: the field command with its --optimizer_cpu_offload line dropped
    text = ("megatron sft --model /m --dataset d --tuner_type lora --train_iters 5 --optimizer_offload_fraction 1.0\n")
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert "optimizer_offload_fraction" not in report["recipe"].get("memory", {})
    assert any(d["flag"] == "--optimizer_offload_fraction" and "no-op" in d["reason"] for d in report["dropped"])
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text.replace("\n", " --optimizer_cpu_offload true\n"),
                           catch_exceptions=False)
    assert json.loads(r.stdout)["recipe"]["memory"]["optimizer_offload_fraction"] == 1.0
