"""The CLI's answers to bad input and to `plan`: exit codes, the last line, and --json error objects."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.ops.cli import main

RUNNABLE = ["run.entrypoint=['/bin/true']", "gpu.check=false", "supervisor.min_free_gib=0"]


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


# --- plan: exit 2 exactly when `run` would stop at pre-flight ------------------------------------

def test_plan_exits_0_when_run_would_start(write_recipe):
    path = write_recipe()
    res = cli("plan", path, *(a for s in RUNNABLE for a in ("--set", s)))
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1] == f"run would start: `orchestrator run {path}`"
    res = cli("plan", path, "--json", *(a for s in RUNNABLE for a in ("--set", s)))
    assert res.exit_code == 0 and json.loads(res.stdout)["would_run"] is True


def test_plan_exits_2_naming_the_failed_check_when_the_model_is_missing(write_recipe):
    path = write_recipe(model={"path": "no-such-model"})
    res = cli("plan", path, *(a for s in RUNNABLE for a in ("--set", s)))
    assert res.exit_code == 2, res.output
    assert "[NOT OK] model:" in res.stdout
    assert res.stdout.splitlines()[-1] == "run would stop at pre-flight: model failed (fix, then plan again)"
    res = cli("plan", path, "--json", *(a for s in RUNNABLE for a in ("--set", s)))
    out = json.loads(res.stdout)  # the same shape, with the verdict added
    assert res.exit_code == 2 and out["would_run"] is False
    assert {"argv", "env", "recipe_hash", "backend", "checks", "memory"} <= set(out)
    assert [c["name"] for c in out["checks"] if not c["ok"] and c["fatal"]] == ["model"]


def test_plan_a_failed_warning_check_does_not_stop_run(write_recipe):
    # the expert count is unknown without config.json and model.num_experts: a warning, not a stop
    path = write_recipe(model={"path": "model"})
    (path.parent / "model" / "config.json").write_text("{}")
    res = cli("plan", path, "--json", *(a for s in RUNNABLE for a in ("--set", s)))
    out = json.loads(res.stdout)
    assert any(not c["ok"] and not c["fatal"] for c in out["checks"]), out["checks"]
    assert res.exit_code == 0 and out["would_run"] is True


# --- recipe errors --------------------------------------------------------------------------------

def test_three_errors_three_lines_on_stderr(write_recipe):
    path = write_recipe(optim={"lrr": 1e-4}, lora={"rank": "8"}, data={"packing": "true"})
    res = cli("run", path)
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 3 and all(ln.startswith(f"orchestrator: error: {path}: ") for ln in lines), lines
    assert "optim.lrr: unknown key (did you mean 'optim.lr'?)" in res.stderr


def test_set_value_attributed_to_set(write_recipe):
    path = write_recipe()
    res = cli("plan", path, "--set", "optim.lr=-1")
    assert res.exit_code == 2
    assert res.stderr == "orchestrator: error: --set 'optim.lr=-1': optim.lr: Input should be greater than 0, got -1\n"


@pytest.mark.parametrize("command", [["plan"], ["status"], ["history"], ["sync", "--once"]])
def test_json_error_object_on_stdout(write_recipe, command):
    path = write_recipe(optim={"lrr": 1e-4})
    res = cli(command[0], path, *command[1:], "--json", "--set", "lora.rank=0")
    assert res.exit_code == 2
    out = json.loads(res.stdout)
    assert set(out) == {"error", "problems"}
    by_key = {p["key"]: p for p in out["problems"]}
    assert {k: p["source"] for k, p in by_key.items()} == {"optim.lrr": str(path), "lora.rank": "--set 'lora.rank=0'"}
    assert by_key["optim.lrr"]["message"] == "unknown key (did you mean 'optim.lr'?)"
    assert out["error"] == "\n".join(ln.removeprefix("orchestrator: error: ") for ln in res.stderr.splitlines())


def test_json_error_object_for_a_file_that_does_not_parse(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[run\n")
    res = cli("verify", tmp_path, "--recipe", path, "--json")
    assert res.exit_code == 2
    out = json.loads(res.stdout)
    assert out["problems"][0]["key"] is None and "TOML syntax error" in out["problems"][0]["message"]


def test_json_error_object_for_other_bad_input(write_recipe):
    res = cli("status", write_recipe(), "--json")  # a valid recipe, but no run has started
    assert res.exit_code == 2
    out = json.loads(res.stdout)
    assert "no journal yet" in out["error"] and out["problems"] == []
