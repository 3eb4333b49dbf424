"""`verify --checksum` never says ok without comparing: every state of a checkpoint's manifest, through the
report and the command (exit codes, one line each, no traceback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_dirs import make_swift

from orchestrator.store import checkpoints as ck
from orchestrator.store import manifest as mf

HASH = "a" * 64


def _write(content: str):
    def fault(d: Path) -> None:
        (d / mf.MANIFEST).write_text(content)
    return fault


def _files(edit):
    def fault(d: Path) -> None:
        m = json.loads((d / mf.MANIFEST).read_text())
        edit(m)
        (d / mf.MANIFEST).write_text(json.dumps(m))
    return fault


def _flip_a_byte(d: Path) -> None:
    raw = bytearray((d / "optimizer.pt").read_bytes())
    raw[5] ^= 0xFF
    (d / "optimizer.pt").write_bytes(bytes(raw))


# (the manifest's state, the fault, "checksums" in the report, ok, words a problem must hold)
ROWS = [
    ("matches", lambda d: None, "compared", True, None),
    ("a file changed after verification", _flip_a_byte, "compared", False, "sha256 differs"),
    ("missing", lambda d: (d / mf.MANIFEST).unlink(), "not compared", False, "has no orchestrator-manifest.json"),
    ("not JSON", _write("{half a manifest"), "not compared", False, "is not valid JSON"),
    ("empty", _write(""), "not compared", False, "is not valid JSON"),
    ("a list, not an object", _write("[]"), "not compared", False, "is malformed"),
    ("files without sha256", _files(lambda m: [f.pop("sha256") for f in m["files"]]), "not compared", False,
     "is malformed"),
    ("a directory in its place", lambda d: ((d / mf.MANIFEST).unlink(), (d / mf.MANIFEST).mkdir()),
     "not compared", False, "cannot be read"),
]


@pytest.mark.parametrize("name,fault,checksums,ok,says", ROWS, ids=[r[0] for r in ROWS])
def test_checksum_states(tmp_path, name, fault, checksums, ok, says):
    d = make_swift(tmp_path, 10)
    mf.write_manifest(d, 10, HASH)
    fault(d)
    rep = ck.verify_report(d, full_checksum=True)
    assert rep["checksums"] == checksums and rep["ok"] is ok, rep
    if says:
        assert any(says in p for p in rep["problems"]), rep["problems"]
    plain = ck.verify_report(d)  # without --checksum: unchanged, the manifest plays no part
    assert plain["checksums"] is None and plain["ok"] is True


def test_a_manifest_of_another_recipe_is_reported(tmp_path):
    d = make_swift(tmp_path, 10)
    mf.write_manifest(d, 10, HASH)
    assert ck.verify_report(d, full_checksum=True, recipe_hash=HASH)["ok"]
    rep = ck.verify_report(d, full_checksum=True, recipe_hash="b" * 64)
    assert not rep["ok"] and rep["checksums"] == "compared"
    assert any(f"names recipe {HASH}, not this recipe's {'b' * 64}" in p for p in rep["problems"])


def test_a_published_copy_under_another_recipes_directory_is_reported(tmp_path):
    own = tmp_path / f"run-{HASH[:8]}"
    own.mkdir()
    mf.write_manifest(make_swift(own, 10), 10, HASH)
    assert ck.verify_report(own / "checkpoint-10", full_checksum=True)["ok"]
    other = tmp_path / "run-bbbbbbbb"
    other.mkdir()
    os.rename(own / "checkpoint-10", other / "checkpoint-10")
    rep = ck.verify_report(other / "checkpoint-10", full_checksum=True)
    assert not rep["ok"] and any("published under run-bbbbbbbb (recipe bbbbbbbb)" in p for p in rep["problems"])


def test_a_file_path_is_never_compared_silently(tmp_path):
    d = make_swift(tmp_path, 10)
    mf.write_manifest(d, 10, HASH)
    rep = ck.verify_report(d / "adapter_model.safetensors", full_checksum=True)
    assert not rep["ok"] and rep["checksums"] == "not compared"
    assert ck.verify_report(d / "adapter_model.safetensors")["ok"]


def _verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "verify", *args], check=False, capture_output=True,
                          text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])


def test_the_command_exits_2_and_says_why(tmp_path):
    d = make_swift(tmp_path, 10)
    r = _verify(str(d), "--checksum")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stdout.startswith("NOT OK") and "checksums not compared:" in r.stdout, r.stdout
    r = _verify(str(d))
    assert r.returncode == 0 and r.stdout.startswith("ok:"), "without --checksum: unchanged"
    mf.write_manifest(d, 10, HASH)
    r = _verify(str(d), "--checksum", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["checksums"] == "compared"
    r = _verify(str(d), "--checksum")
    assert r.returncode == 0 and "sha256 as in its manifest" in r.stdout
