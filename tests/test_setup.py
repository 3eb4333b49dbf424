"""scripts/setup.sh and the packaging metadata work on any Linux machine with a package index: torch is
asked for as the plain 2.13.0 (no local `+cpu` build tag, which the public index does not serve), setup
reports progress, and nothing names a particular build environment."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib

from recipes import ROOT

LOCAL_TAG = re.compile(r"torch==[0-9.]+\+")


def test_torch_is_asked_for_without_a_local_build_tag():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "torch==2.13.0" in extras["swift"]
    for path in ("pyproject.toml", "constraints/swift-cpu.txt", "scripts/setup.sh"):
        assert not LOCAL_TAG.search((ROOT / path).read_text()), path
    assert "torch==2.13.0" in (ROOT / "constraints/swift-cpu.txt").read_text().splitlines()


def test_nothing_names_a_build_environment():
    for path in ("README.md", "pyproject.toml", "scripts/setup.sh"):
        assert "build farm" not in (ROOT / path).read_text().lower(), path


STUB = """#!/bin/sh
echo "$*" >> "$SETUP_LOG"
[ "$1 $2" = "-c import torch" ] && exit 1
exit 0
"""


def test_setup_reports_each_step_and_installs_plain_torch(tmp_path):
    """setup.sh run against a stub python that records what it is asked to do (no network, no install)."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tree / "scripts" / "setup.sh")
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "orchestrator").write_text("#!/bin/sh\necho 'orchestrator, version 0.1.0'\n")
    (bin_dir / "orchestrator").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(bin_dir / "python3"), "SETUP_LOG": str(log),
           "PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    res = subprocess.run(["bash", str(tree / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split(" (")[0].split(",")[0] for ln in lines] == [
        "setup: installing torch 2.13.0", "setup: installing orchestrator[swift] with ms-swift 4.6.0 and the pins in "
        "constraints/swift-cpu.txt ...", "setup: ok"]
    assert "extra index: https://download.pytorch.org/whl/cpu" in lines[0]
    calls = log.read_text().splitlines()
    assert any(c.endswith("pip --disable-pip-version-check -q install torch==2.13.0") for c in calls), calls
    assert any("install -e .[swift] -c constraints/swift-cpu.txt" in c for c in calls), calls
