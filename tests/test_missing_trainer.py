"""A trainer executable that does not exist: `run` refuses at pre-flight (exit 2, nothing launched),
and a launch whose executable vanished after pre-flight raises LaunchError, not FileNotFoundError."""
from __future__ import annotations

import json
import os

import pytest

from orchestrator.host.launch import local as launcher
from orchestrator.types import Command, ExitCode
from supervised import attempts, cli, fake_recipe

MISSING = "/nonexistent/bin/trainer"


def test_run_refuses_a_missing_entrypoint(tmp_path):
    recipe = fake_recipe(tmp_path, run={"entrypoint": [MISSING, "--flag"]})
    r = cli("run", str(recipe))
    assert r.returncode == ExitCode.BAD_INPUT, r.stderr
    assert f"pre-flight trainer: run.entrypoint[0] = '{MISSING}': no executable file at that path" in r.stderr
    assert "Traceback" not in r.stderr
    assert attempts(tmp_path / "out") == []


def test_plan_shows_the_missing_trainer(tmp_path):
    r = cli("plan", str(fake_recipe(tmp_path, run={"entrypoint": [MISSING]})), "--json")
    assert r.returncode == 2, r.stderr   # a check that stops `run` fails: plan says so by its exit code
    assert json.loads(r.stdout)["would_run"] is False
    trainer = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["trainer"]
    assert trainer["ok"] is False and trainer["fatal"] is True and MISSING in trainer["detail"]


@pytest.mark.parametrize("argv,cwd,fragment", [
    ((MISSING, "sft"), None, f"cannot start the trainer '{MISSING}'"),
    (("no-such-trainer-xyz",), None, "'no-such-trainer-xyz'"),
    (("true",), "/nonexistent/cwd", "/nonexistent/cwd"),
])
def test_launch_of_a_vanished_executable_raises_launch_error(tmp_path, argv, cwd, fragment):
    log = tmp_path / "attempt.log"
    with pytest.raises(launcher.LaunchError) as e:
        launcher.launch(Command(argv=argv, env={}), log, "run-x", cwd=cwd)
    assert fragment in str(e.value) and "run.entrypoint" in str(e.value)
    assert isinstance(e.value.__cause__, OSError)


def test_launch_of_a_file_that_is_not_executable(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    with pytest.raises(launcher.LaunchError, match="Permission denied"):
        launcher.launch(Command(argv=(str(script),), env={}), tmp_path / "a.log", "run-x")


def test_locate_agrees_with_launch(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    assert launcher.locate(str(script)) == str(script)
    assert launcher.locate("train.sh", env_path=str(tmp_path)) == str(script)
    assert launcher.locate("./train.sh", cwd=str(tmp_path)) == os.path.join(str(tmp_path), "./train.sh")
    assert launcher.locate(MISSING) is None
    done = launcher.launch(Command(argv=(str(script),), env={}), tmp_path / "a.log", "run-x")
    assert done.exited.wait(10) and done.status.code == 0
