"""The systemd units (shipped and rendered) pass `systemd-analyze verify`; install-service writes
what it says, and nothing in a dry run."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from orchestrator.ops import service
from orchestrator.ops.service import (DEFAULT_EXE, TEMPLATES, InstallError, install_service, render_unit,
                                  validate_name)

REPO = Path(__file__).resolve().parent.parent
SYSTEMD_DIR = REPO / "systemd"
ANALYZE = shutil.which("systemd-analyze") or ("/usr/bin/systemd-analyze"
                                              if os.path.exists("/usr/bin/systemd-analyze") else None)
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")

RECIPE = """\
[run]
name = "demo-run"
output_dir = "/data/out/demo"
persistent_dir = "/mnt/persist/demo"

[model]
path = "/models/tiny"

[data]
dataset = ["/data/train.jsonl", "AI-ModelScope/alpaca-gpt4-data-en"]

[optim]
lr = 1e-4
iterations = 10
"""


@pytest.fixture
def fake_exe(tmp_path) -> str:
    """An existing executable for ExecStart= (verify checks that the binary exists)."""
    d = tmp_path / "venv $x %i" / "bin"   # exercises ExecStart= quoting and escaping
    d.mkdir(parents=True)
    exe = d / "orchestrator"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def recipe(tmp_path) -> Path:
    p = tmp_path / "src" / "demo.toml"
    p.parent.mkdir()
    p.write_text(RECIPE)
    return p


def verify(units: dict[str, str], workdir: Path) -> str:
    """Write units under their instance names (orchestrator@.service -> orchestrator@demo.service)
    and run `systemd-analyze verify` on them; returns its output (empty when clean)."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for template, text in units.items():
        path = workdir / template.replace("@.", "@demo.")
        path.write_text(text)
        paths.append(str(path))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
    p = subprocess.run([ANALYZE, "verify", "--man=no", "--recursive-errors=no", *paths],
                       capture_output=True, text=True, env=env, timeout=120)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 0 or out, "verify failed without saying why"
    return out if p.returncode == 0 else out or f"exit {p.returncode}"


def shipped() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SYSTEMD_DIR.iterdir()) if p.suffix in (".service", ".timer")}


def test_shipped_units_are_the_rendered_defaults():
    # Regenerate with: python3 -c "from orchestrator.ops.service import TEMPLATES, render_unit as r;
    #   [open('systemd/'+t, 'w').write(r(t)) for t in TEMPLATES]"
    assert set(shipped()) == set(TEMPLATES)
    for name, text in shipped().items():
        assert text == render_unit(name), f"systemd/{name} is out of date with orchestrator/ops/service.py"


@needs_analyze
def test_verify_catches_mistakes(tmp_path, fake_exe):
    # Guard: the verify helper really reports problems (otherwise the tests below prove nothing).
    bad = render_unit(exe=fake_exe).replace("KillMode=mixed", "KillMode=mixed\nWatchdogSek=5")
    assert "WatchdogSek" in verify({"orchestrator@.service": bad}, tmp_path / "bad")
    missing = render_unit(exe="/nonexistent/orchestrator")
    assert "/nonexistent/orchestrator" in verify({"orchestrator@.service": missing}, tmp_path / "missing")


@needs_analyze
def test_shipped_units_verify(tmp_path, fake_exe):
    # The shipped files name /opt/orchestrator/venv/bin/orchestrator, absent here: point it at an
    # existing executable, change nothing else.
    quoted = service._exec_start(fake_exe)
    units = {name: text.replace(DEFAULT_EXE, quoted) for name, text in shipped().items()}
    assert all(quoted in t for n, t in units.items() if n.endswith(".service"))
    assert verify(units, tmp_path / "units") == ""


@needs_analyze
def test_rendered_units_verify(tmp_path, fake_exe):
    units = {t: render_unit(t, exe=fake_exe, etc_dir=str(tmp_path / "etc")) for t in TEMPLATES}
    assert verify(units, tmp_path / "units") == ""
    units = {t: render_unit(t, exe=["/usr/bin/python3", "-m", "orchestrator"]) for t in TEMPLATES}
    assert verify(units, tmp_path / "units2") == ""


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_key_directives():
    d = directives(render_unit())
    one = {k: v[-1] for k, v in d.items()}
    assert one["Type"] == "notify"
    assert one["NotifyAccess"] == "main"
    assert int(one["WatchdogSec"]) >= 30
    assert one["Restart"] == "always"
    assert one["RestartSec"] == "90"
    assert one["KillMode"] == "mixed"
    assert one["KillSignal"] == "SIGTERM"
    assert {"2", "3"} <= set(one["RestartPreventExitStatus"].split())
    assert "0" in one["SuccessExitStatus"].split()
    assert int(one["TimeoutStopSec"]) >= 600
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["LimitNOFILE"] == "1048576"
    assert one["StandardOutput"] == one["StandardError"] == "journal"
    assert one["EnvironmentFile"] == "-/etc/orchestrator/%i.env"
    assert one["ExecStart"] == f"{DEFAULT_EXE} run /etc/orchestrator/%i.toml"
    assert one["OOMPolicy"] == "continue"
    assert one["WorkingDirectory"]
    for hidden in ("PrivateDevices", "DevicePolicy", "ProtectKernelTunables", "MemoryDenyWriteExecute",
                   "ProtectSystem", "PrivateTmp"):
        assert hidden not in d, f"{hidden}= would break GPUs/CUDA"
    sync = directives(render_unit("orchestrator-sync@.service"))
    assert sync["Type"] == ["oneshot"] and sync["ExecStart"][0].endswith("sync /etc/orchestrator/%i.toml --once")
    timer = directives(render_unit("orchestrator-sync@.timer"))
    assert timer["OnUnitActiveSec"] == ["5min"]


def test_exec_start_quoting(fake_exe):
    line = directives(render_unit(exe=fake_exe))["ExecStart"][0]
    assert line == '"' + fake_exe.replace("%", "%%") + '" run /etc/orchestrator/%i.toml'
    assert service._exec_start(["/opt/a%b/$x", "$y", "a b"]) == '"/opt/a%%b/$x" "$$y" "a b"'
    with pytest.raises(InstallError, match="absolute"):
        render_unit(exe="orchestrator")
    with pytest.raises(InstallError, match="etc-dir"):
        render_unit(etc_dir="/etc/my orchestrator")


def test_install_writes_files_and_returns_commands(tmp_path, recipe, fake_exe):
    units, etc = tmp_path / "units", tmp_path / "etc"
    r = install_service(recipe, unit_dir=str(units), etc_dir=str(etc), exe=fake_exe)
    assert r.name == "demo-run"                    # run.name wins over the file name
    assert r.unit == "orchestrator@demo-run.service"
    written = {p for p, _ in r.files}
    assert written == {str(units / "orchestrator@.service"), str(etc / "demo-run.toml"), str(etc / "demo-run.env")}
    for path, content in r.files:
        assert Path(path).read_text() == content
    assert (etc / "demo-run.toml").read_text() == RECIPE
    unit = (units / "orchestrator@.service").read_text()
    assert f"run {etc}/%i.toml" in unit and f"EnvironmentFile=-{etc}/%i.env" in unit
    env = (etc / "demo-run.env").read_text()
    assert "PYTHONUNBUFFERED=1" in env and "# CUDA_VISIBLE_DEVICES" in env and "# HF_HUB_OFFLINE=1" in env
    assert stat.S_IMODE((etc / "demo-run.env").stat().st_mode) == 0o600
    assert r.commands == ["systemctl daemon-reload", "systemctl enable --now orchestrator@demo-run.service",
                          "journalctl -u orchestrator@demo-run.service -f"]
    assert "systemctl daemon-reload" in r.text()
    assert not list(tmp_path.rglob("*.tmp-*"))

    # Again with an edited recipe and an operator-edited env file: recipe replaced with a
    # backup, env kept.
    (etc / "demo-run.env").write_text("HF_HOME=/x\n")
    recipe.write_text(RECIPE.replace("iterations = 10", "iterations = 20"))
    r2 = install_service(recipe, unit_dir=str(units), etc_dir=str(etc), exe=fake_exe)
    assert (etc / "demo-run.env").read_text() == "HF_HOME=/x\n"
    assert "iterations = 20" in (etc / "demo-run.toml").read_text()
    backups = list(etc.glob("demo-run.toml.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == RECIPE
    assert any("kept" in n for n in r2.notes) and any("replaced" in n for n in r2.notes)


@needs_analyze
def test_installed_unit_verifies(tmp_path, recipe, fake_exe):
    r = install_service(recipe, name="demo", unit_dir=str(tmp_path / "u"), etc_dir=str(tmp_path / "etc"),
                        exe=fake_exe, sync_timer=True)
    assert "systemctl enable --now orchestrator-sync@demo.timer" in r.commands
    units = {Path(p).name: c for p, c in r.files if p.startswith(str(tmp_path / "u"))}
    assert set(units) == set(TEMPLATES)
    assert verify(units, tmp_path / "verify") == ""


def test_dry_run_writes_nothing(tmp_path, recipe, fake_exe):
    before = sorted(tmp_path.rglob("*"))
    r = install_service(recipe, name="demo", unit_dir=str(tmp_path / "u"), etc_dir=str(tmp_path / "etc"),
                        exe=fake_exe, dry_run=True, sync_timer=True)
    assert sorted(tmp_path.rglob("*")) == before
    assert r.dry_run and len(r.files) == 5
    text = r.text()
    assert "would write" in text and "Type=notify" in text and "PYTHONUNBUFFERED=1" in text
    assert "systemctl enable --now orchestrator@demo.service" in text


def test_default_name_is_file_stem_and_default_exe(tmp_path, fake_exe):
    p = tmp_path / "my.run_1.toml"
    p.write_text(RECIPE.replace('name = "demo-run"\n', ""))
    r = install_service(p, unit_dir=str(tmp_path / "u"), etc_dir=str(tmp_path / "e"), dry_run=True)
    assert r.name == "my.run_1"
    unit = dict(r.files)[str(tmp_path / "u" / "orchestrator@.service")]
    exe_line = directives(unit)["ExecStart"][0]
    assert os.path.isabs(exe_line.strip('"').split()[0].strip('"'))


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "../x", ".hidden", "x;rm", "ü", "a\nb", "x" * 201])
def test_bad_instance_name_rejected(tmp_path, recipe, bad):
    with pytest.raises(InstallError, match="invalid service instance name"):
        install_service(recipe, name=bad, unit_dir=str(tmp_path / "u"), etc_dir=str(tmp_path / "e"))
    assert not (tmp_path / "u").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize("good", ["demo", "qwen3-235b_lora.v2", "A.1"])
def test_good_instance_names(good):
    assert validate_name(good) == good


def test_relative_paths_rejected(tmp_path):
    p = tmp_path / "rel.toml"
    p.write_text(RECIPE.replace('"/data/out/demo"', '"out/demo"').replace('"/data/train.jsonl"', '"./train.jsonl"'))
    with pytest.raises(InstallError, match=r"run\.output_dir.*data\.dataset"):
        install_service(p, dry_run=True)


def test_unreadable_or_broken_recipe(tmp_path):
    with pytest.raises(InstallError, match="cannot read"):
        install_service(tmp_path / "missing.toml", dry_run=True)
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(InstallError, match="TOML"):
        install_service(bad, dry_run=True)


def test_unwritable_target_is_a_clear_error(tmp_path, recipe, fake_exe):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InstallError, match="cannot write"):
        install_service(recipe, unit_dir=str(blocker / "sub"), etc_dir=str(tmp_path / "e"), exe=fake_exe)
