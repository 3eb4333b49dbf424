"""Prepare the GPU check here, with network: fetch the wheels the device image lacks, check that what
travels stays under the device tool's limit, and print the exact `run` call.

    python bench/gpu/prepare.py            # download into .gpu-wheels/, check the size, print the call
    python bench/gpu/prepare.py --check    # no download: check the folder as it is, print the call

What is carried: the closure of the orchestrator's own requirements (pyproject.toml), ms-swift 4.6.0 and
the optional GPU pieces (flash-linear-attention; megatron-core + mcore-bridge), less what the device image
already holds (bench/gpu/device-image.txt). A requirement is followed into its wheel's METADATA, evaluated
for the device's Python 3.12 on x86-64 Linux. Versions: the project's pins in constraints/swift-cpu.txt
where they satisfy the requirement, else the newest the index has. The optional pieces are dropped, last
first, when the whole would not fit. Exit 0: ready; 2: over the limit or bad input; 3: a download failed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare python3 with pip: pip vendors the same library
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef,assignment]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef,assignment]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef,assignment]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WHEEL_DIR = ".gpu-wheels"          # ignored (.gitignore); named in the run call's carry
LIMIT_BYTES = 64 * 1024**2         # the device tool: working tree + carried paths, per call
SWIFT = "ms-swift==4.6.0"
OPTIONAL = ("flash-linear-attention", "megatron-core>=0.16,<0.20", "mcore-bridge>=1.6.3")  # dropped last first
TIMEOUT_S = 600                    # the check: ~30 s install, its 420 s budget, at most ~120 s over in its last step
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_24_x86_64")

# (pip requirement specs, folder) -> wheels saved there; returns {spec: why not} for those it could not provide
Fetch = Callable[[list[str], Path], dict[str, str]]


class PrepareError(Exception):
    """A problem prepare reports as one line and an exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class Plan:
    """The wheels to carry and why the rest stays behind."""

    wheels: dict[str, Path] = field(default_factory=dict)          # canonical name -> wheel file
    on_device: dict[str, str] = field(default_factory=dict)        # name -> the device's version ("" unknown)
    dropped: list[str] = field(default_factory=list)               # optional roots left out (size)
    warnings: list[str] = field(default_factory=list)


def device_packages(path: Path = HERE / "device-image.txt") -> dict[str, str]:
    """Read the device image's package list: canonical name -> version ("" where none was seen)."""
    out: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def pins(path: Path = REPO / "constraints" / "swift-cpu.txt") -> dict[str, str]:
    """Read the project's pinned versions (name==version lines): canonical name -> version."""
    out: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[canonicalize_name(name)] = version.strip()
    return out


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """Return the orchestrator's own runtime requirements (it travels as source; its needs as wheels)."""
    return list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"])


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """Return a wheel's requirements that apply on the device (markers evaluated, extras skipped)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode("utf-8", errors="replace")
    reqs = []
    for line in text.splitlines():
        if line == "":
            break  # the headers end at the first blank line; the description follows
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate(MARKER_ENV):
                reqs.append(r)
    return reqs


def wheel_name(wheel: Path) -> tuple[str, str]:
    """Return (canonical name, version) from a wheel's file name."""
    parts = wheel.name.split("-")
    return canonicalize_name(parts[0]), parts[1]


def spec_for(req: Requirement, pinned: dict[str, str]) -> str:
    """The pip spec to fetch for `req`: the project's pin where it satisfies it, else the requirement."""
    name = canonicalize_name(req.name)
    pin = pinned.get(name)
    if pin and req.specifier.contains(pin, prereleases=True):
        return f"{name}=={pin}"
    return f"{name}{req.specifier}"


def needs_carrying(req: Requirement, device: dict[str, str]) -> bool:
    """True when the device lacks the package, or has a known version the requirement refuses."""
    have = device.get(canonicalize_name(req.name))
    if have is None:
        return True
    return bool(have) and not req.specifier.contains(have, prereleases=True)


def resolve(roots: list[str], device: dict[str, str], pinned: dict[str, str], dest: Path, fetch: Fetch) -> Plan:
    """Fetch the closure of `roots` that the device lacks into `dest`, one breadth-first layer per fetch."""
    plan = Plan()
    wanted: dict[str, Requirement] = {}
    layer = [Requirement(r) for r in roots]
    while layer:
        todo = []
        for req in layer:
            name = canonicalize_name(req.name)
            if name in wanted:
                have = wheel_name(plan.wheels[name])[1] if name in plan.wheels else None
                if have and not req.specifier.contains(have, prereleases=True):
                    plan.warnings.append(f"{name} {have} carried, but another requirement asks {req}")
                continue
            if not needs_carrying(req, device):
                plan.on_device[name] = device[name]
                continue
            wanted[name] = req
            todo.append(req)
        if not todo:
            break
        specs = [Requirement(spec_for(r, pinned)) for r in todo]
        unavailable = fetch([str(s) for s in specs], dest)
        missing = []
        layer = []
        for s in specs:
            if str(s) in unavailable:
                plan.warnings.append(f"{s} not carried: {unavailable[str(s)]}")
                continue
            w = pick(dest, s)
            if w is None:
                missing.append(str(s))
                continue
            plan.wheels[canonicalize_name(s.name)] = w
            layer += wheel_requirements(w)
        if missing:
            raise PrepareError(f"no wheel came for {', '.join(missing)} (see pip's output above)", 3)
    return plan


def pick(folder: Path, spec: Requirement) -> Path | None:
    """Return the newest wheel in `folder` that satisfies `spec` (an older download may lie beside it)."""
    name = canonicalize_name(spec.name)
    fits = [(Version(v), w) for w in folder.glob("*.whl") for n, v in [wheel_name(w)]
            if n == name and spec.specifier.contains(v, prereleases=True)]
    return max(fits)[1] if fits else None


def pip_fetch(specs: list[str], dest: Path) -> dict[str, str]:
    """Download binary wheels for the device (Python 3.12, manylinux x86-64), no dependencies; a package
    published only as source is built into a wheel here and kept when that wheel is pure Python."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    unavailable = {}
    for spec in specs:  # one by one: pip stops at the first spec it cannot find, naming it
        if subprocess.run(cmd + [spec], stderr=subprocess.DEVNULL, check=False).returncode == 0:
            continue
        built = Path(tempfile.mkdtemp(prefix="gpu-wheel-"))
        try:
            if subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary=:all:", "-w",
                               str(built), spec], check=False).returncode != 0:
                raise PrepareError(f"pip found no wheel for {spec} (Python 3.12, manylinux x86-64) and could not "
                                   "build one from its source", 3)
            for w in built.glob("*.whl"):
                if w.name.endswith("-none-any.whl"):
                    shutil.move(str(w), dest / w.name)
                else:
                    unavailable[spec] = f"published only as source, and it builds a platform wheel ({w.name})"
        finally:
            shutil.rmtree(built, ignore_errors=True)
    return unavailable


def tree_bytes(repo: Path | None = None) -> int:
    """Return the bytes of the working tree that travels with each call (tracked + untracked-not-ignored)."""
    repo = REPO if repo is None else repo
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.decode().split("\0"):
        p = repo / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    """Return the bytes of the files under `folder` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def size_report(wheels: Path, tree: int, limit: int | None = None) -> dict:
    """What travels against the limit: {"wheels_bytes", "tree_bytes", "total_bytes", "limit_bytes", "ok"}."""
    limit = LIMIT_BYTES if limit is None else limit
    w = folder_bytes(wheels)
    return {"wheels_bytes": w, "tree_bytes": tree, "total_bytes": w + tree, "limit_bytes": limit,
            "ok": w + tree < limit}


def duplicates(folder: Path) -> list[str]:
    """Return the packages with more than one wheel in `folder` (two versions stop the whole install)."""
    seen: dict[str, list[str]] = {}
    for w in folder.glob("*.whl"):
        seen.setdefault(wheel_name(w)[0], []).append(w.name)
    return sorted(n for n, ws in seen.items() if len(ws) > 1)


def run_call(carry: str = WHEEL_DIR, timeout_s: int = TIMEOUT_S) -> dict:
    """The device tool's `run` arguments that start the check."""
    return {"command": "bash bench/gpu/check.sh", "carry": [carry], "timeout_s": timeout_s}


def prune(folder: Path, keep: dict[str, Path]) -> list[str]:
    """Delete wheels in `folder` that the plan does not carry (older versions, dropped pieces)."""
    gone = []
    for w in folder.glob("*.whl"):
        if keep.get(wheel_name(w)[0]) != w:
            w.unlink()
            gone.append(w.name)
    return gone


def install_check(folder: Path) -> str | None:
    """Dry-run the device's install of every wheel in `folder` for Python 3.12 on manylinux x86-64, offline;
    pip's complaint, or None when they would all install."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return f"{folder}: no wheels"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--no-index", "--no-deps", "--ignore-requires-python",
           "--target", str(folder / ".dry-run"), "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
           "--abi", "abi3", "--abi", "none", "--only-binary=:all:"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    done = subprocess.run(cmd + wheels, capture_output=True, text=True, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    return None if done.returncode == 0 else "\n".join(errors) or done.stderr.strip() or f"pip exited {done.returncode}"


def prepare(dest: Path, fetch: Fetch = pip_fetch, tree: int | None = None, limit: int | None = None,
            device: dict[str, str] | None = None, pinned: dict[str, str] | None = None,
            roots: list[str] | None = None) -> tuple[Plan, dict]:
    """Fetch what the device lacks into `dest`, dropping optional pieces until what travels fits `limit`."""
    dest.mkdir(parents=True, exist_ok=True)
    device = device_packages() if device is None else device
    pinned = pins() if pinned is None else pinned
    base = (project_requirements() + [SWIFT]) if roots is None else roots
    tree = tree_bytes() if tree is None else tree
    optional = list(OPTIONAL)
    while True:
        plan = resolve(base + optional, device, pinned, dest, fetch)
        plan.dropped = [o for o in OPTIONAL if o not in optional]
        prune(dest, plan.wheels)
        size = size_report(dest, tree, limit)
        if size["ok"] or not optional:
            return plan, size
        optional.pop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu/prepare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / WHEEL_DIR, help="the wheel folder (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="download nothing: check the folder as it is")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    try:
        dest = a.dest.resolve()
        carry = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else None
        if carry is None:
            raise PrepareError(f"{dest}: the wheel folder must be inside the repository ({REPO}) to travel")
        if a.check:
            if not dest.is_dir():
                raise PrepareError(f"{dest}: no wheel folder (run bench/gpu/prepare.py without --check first)")
            plan, size = Plan(wheels={wheel_name(w)[0]: w for w in dest.glob("*.whl")}), size_report(dest, tree_bytes())
        else:
            plan, size = prepare(dest)
        dup = duplicates(dest)
        if dup:
            raise PrepareError(f"{dest}: more than one wheel of {', '.join(dup)} (the install would stop): delete all but one")
        refused = install_check(dest)
        if refused:
            raise PrepareError(f"the device's install would fail (pip install --dry-run for Python 3.12):\n{refused}")
    except PrepareError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return e.code
    call = run_call(carry)
    result = {"wheels": sorted(w.name for w in plan.wheels.values()), "dropped": plan.dropped,
              "warnings": plan.warnings, "size": size, "run": call}
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        mib = 1024**2
        for w in plan.warnings:
            print(f"warning: {w}")
        print(f"{len(plan.wheels)} wheels in {carry}/: {size['wheels_bytes'] / mib:.1f} MiB; working tree "
              f"{size['tree_bytes'] / mib:.1f} MiB; together {size['total_bytes'] / mib:.1f} of "
              f"{size['limit_bytes'] / mib:.0f} MiB" + ("" if size["ok"] else ": OVER THE LIMIT"))
        if plan.dropped:
            print(f"left out to fit: {', '.join(plan.dropped)} (their steps will say skipped)")
        print("the device call (the device tool's run):")
        print(json.dumps(call))
    if not size["ok"]:
        print(f"prepare: error: {size['total_bytes']} bytes would travel, the limit is {size['limit_bytes']}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
