"""bench/gpu/prepare.py without network: which requirements it carries (the device image's list, markers for
Python 3.12 on x86-64, the project's pins), dropping the optional pieces to fit, the size check against the
device tool's 64 MiB, the offline install dry run, and the exact run call it prints. Fake wheels stand in
for the index."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import prepare

MIB = 1024**2


def fake_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), pad: int = 0,
               tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel: METADATA (with Requires-Dist), WHEEL, RECORD, and `pad` bytes of data."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires), "\nA description.\nRequires-Dist: not-a-header\n"])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name.replace('-', '_')}/__init__.py", "x" * pad)
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


class FakeIndex:
    """pip download stand-in: serves `packages` {name: (version, requires, pad bytes)}; records each fetch."""

    def __init__(self, packages: dict, source_only: dict | None = None):
        self.packages, self.source_only, self.fetched = packages, source_only or {}, []

    def __call__(self, specs: list[str], dest: Path) -> dict[str, str]:
        self.fetched.append(specs)
        unavailable = {}
        for spec in specs:
            name = prepare.Requirement(spec).name
            if name in self.source_only:
                unavailable[spec] = self.source_only[name]
                continue
            version, requires, pad = self.packages[name]
            fake_wheel(dest, name, version, requires, pad)
        return unavailable


INDEX = {
    "ms-swift": ("4.6.0", ("transformers<5.20,>=4.33", "peft<0.21", "oss2", "datasets<4.8.5,>=4.0",
                           'evalscope; extra == "eval"', 'tomli; python_version < "3.11"'), 0),
    "pydantic": ("2.14.3", ("pydantic-core==2.50.4", "typing-extensions>=4.6"), 0),
    "pydantic-core": ("2.50.4", (), 0),
    "datasets": ("4.8.4", ("dill", "numpy"), 0),
    "dill": ("0.4.1", (), 0),
    "transformers": ("5.19.0", (), 0),
    "flash-linear-attention": ("0.6.0", ("fla-core==0.6.0",), 2 * MIB),
    "fla-core": ("0.6.0", (), 2 * MIB),
    "megatron-core": ("0.19.2", (), 3 * MIB),
    "mcore-bridge": ("1.6.5", ("megatron-core>=0.16",), 0),
}
DEVICE = {"transformers": "5.17.0", "peft": "", "numpy": "2.5.2", "typing-extensions": "", "torch": "2.11.0"}
PINS = {"pydantic": "2.14.3", "pydantic-core": "2.50.4", "datasets": "4.8.4", "transformers": "5.19.0"}


def test_the_closure_carries_what_the_device_lacks_for_python_3_12(tmp_path):
    index = FakeIndex(INDEX, source_only={"oss2": "published only as source, and it builds a platform wheel"})
    plan = prepare.resolve(["pydantic>=2.6,<3", "ms-swift==4.6.0"], DEVICE, PINS, tmp_path, index)
    assert sorted(plan.wheels) == ["datasets", "dill", "ms-swift", "pydantic", "pydantic-core"]
    assert plan.on_device == {"transformers": "5.17.0", "peft": "", "typing-extensions": "", "numpy": "2.5.2"}
    assert plan.warnings == ["oss2 not carried: published only as source, and it builds a platform wheel"]
    assert index.fetched[0] == ["pydantic==2.14.3", "ms-swift==4.6.0"]   # the project's pin where it fits
    flat = [s for layer in index.fetched for s in layer]
    assert not any(s.startswith(("evalscope", "tomli")) for s in flat)     # extras and other Pythons' markers


def test_a_device_package_whose_known_version_the_requirement_refuses_is_carried(tmp_path):
    plan = prepare.resolve(["transformers>=5.18"], DEVICE, PINS, tmp_path, FakeIndex(INDEX))
    assert list(plan.wheels) == ["transformers"] and plan.wheels["transformers"].name.startswith("transformers-5.19.0")


def test_optional_pieces_are_dropped_last_first_until_what_travels_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "OPTIONAL", ("flash-linear-attention", "megatron-core>=0.16,<0.20",
                                              "mcore-bridge>=1.6.3"))
    dest = tmp_path / "w"
    plan, size = prepare.prepare(dest, FakeIndex(INDEX), tree=1 * MIB, limit=6 * MIB, device=DEVICE, pinned=PINS,
                                 roots=["pydantic"])
    assert plan.dropped == ["megatron-core>=0.16,<0.20", "mcore-bridge>=1.6.3"]
    assert sorted(plan.wheels) == ["fla-core", "flash-linear-attention", "pydantic", "pydantic-core"]
    assert sorted(w.name.split("-")[0] for w in dest.glob("*.whl")) == sorted(
        ["fla_core", "flash_linear_attention", "pydantic", "pydantic_core"])       # the dropped ones' wheels deleted
    assert size["ok"] and size["total_bytes"] < 6 * MIB


def test_size_report_counts_the_wheels_and_the_tree_against_the_limit(tmp_path):
    fake_wheel(tmp_path, "a", "1", pad=MIB)
    assert prepare.size_report(tmp_path, tree=2 * MIB, limit=4 * MIB)["ok"]
    over = prepare.size_report(tmp_path, tree=3 * MIB, limit=4 * MIB)
    assert not over["ok"] and over["total_bytes"] == over["wheels_bytes"] + 3 * MIB > 4 * MIB


def test_two_versions_of_one_package_are_found_and_the_newest_fitting_one_picked(tmp_path):
    fake_wheel(tmp_path, "pydantic", "2.10.0")
    fake_wheel(tmp_path, "pydantic", "2.14.3")
    assert prepare.duplicates(tmp_path) == ["pydantic"]
    assert prepare.pick(tmp_path, prepare.Requirement("pydantic>=2.6")).name.startswith("pydantic-2.14.3")
    assert prepare.pick(tmp_path, prepare.Requirement("pydantic<2.12")).name.startswith("pydantic-2.10.0")


def test_the_install_dry_run_accepts_pure_wheels_and_refuses_another_pythons(tmp_path):
    fake_wheel(tmp_path, "a", "1")
    assert prepare.install_check(tmp_path) is None
    fake_wheel(tmp_path, "b", "1", tag="cp311-cp311-manylinux_2_17_x86_64")
    refused = prepare.install_check(tmp_path)
    assert refused and "b-1-cp311-cp311-manylinux_2_17_x86_64.whl is not a supported wheel" in refused


def test_the_device_image_list_lacks_pydantic_and_knows_torch():
    device = prepare.device_packages()
    assert "pydantic" not in device and "ms-swift" not in device
    assert device["torch"] == "2.11.0" and device["nvidia-ml-py"] == ""


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git checkout with one tracked file and a wheel folder, as prepare.py's REPO."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tracked.txt").write_bytes(b"t" * 1000)
    (tmp_path / ".gitignore").write_text("/.gpu-wheels/\n")
    wheels = tmp_path / ".gpu-wheels"
    wheels.mkdir()
    fake_wheel(wheels, "pydantic", "2.14.3", pad=MIB)
    monkeypatch.setattr(prepare, "REPO", tmp_path)
    return tmp_path


def test_check_prints_the_run_call_with_the_carry_list(repo, capsys):
    assert prepare.main(["--check", "--dest", str(repo / ".gpu-wheels"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == {"command": "bash bench/gpu/check.sh", "carry": [".gpu-wheels"], "timeout_s": 600}
    assert out["wheels"] == ["pydantic-2.14.3-py3-none-any.whl"]
    assert out["size"]["tree_bytes"] == 1000 + len("/.gpu-wheels/\n")    # the ignored wheels are not the tree
    assert out["size"]["ok"] and out["size"]["total_bytes"] > MIB


def test_check_refuses_what_would_travel_over_the_limit(repo, capsys, monkeypatch):
    monkeypatch.setattr(prepare, "LIMIT_BYTES", MIB)
    assert prepare.main(["--check", "--dest", str(repo / ".gpu-wheels")]) == 2
    captured = capsys.readouterr()
    assert "OVER THE LIMIT" in captured.out
    assert "prepare: error:" in captured.err and "the limit is 1048576" in captured.err


@pytest.mark.parametrize("setup, message", [
    (lambda repo: fake_wheel(repo / ".gpu-wheels", "pydantic", "2.10.0"), "more than one wheel of pydantic"),
    (lambda repo: None, "must be inside the repository"),
])
def test_check_refuses_a_folder_that_would_not_install_or_travel(repo, capsys, setup, message, tmp_path_factory):
    setup(repo)
    dest = repo / ".gpu-wheels" if "repository" not in message else tmp_path_factory.mktemp("elsewhere")
    assert prepare.main(["--check", "--dest", str(dest)]) == 2
    assert message in capsys.readouterr().err
