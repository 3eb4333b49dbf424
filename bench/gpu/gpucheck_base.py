"""What the GPU check's steps share: the step record, the context they run in (where logs go, the time
left, the environment for child processes), why a need is missing, and the two ways a step ends early."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gpucheck_procs as procs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class Skip(Exception):
    """The step cannot run here; the message says why."""


class Failed(Exception):
    """The step ran and found something wrong; `result` keeps what it measured."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result or {}


@dataclass
class Step:
    name: str
    run: Callable[[Ctx], dict]
    needs: tuple[str, ...]   # "cuda", "swift", "fla", "megatron"
    est_s: float             # about what it takes on the device; skipped when less of the budget is left
    proves: str


@dataclass
class Ctx:
    out: Path
    work: Path
    budget_s: float
    python: str = sys.executable
    started: float = field(default_factory=time.monotonic)
    cache: dict = field(default_factory=dict)

    @property
    def here(self) -> Path:
        return HERE

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def log(self, name: str) -> Path:
        return self.logs / name

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def timeout(self, want_s: float, floor_s: float = 30.0) -> float:
        """A child's time limit: `want_s`, cut to what is left of the budget (never under `floor_s`)."""
        return max(floor_s, min(want_s, self.left_s()))

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for child processes: this one, the repository first on PYTHONPATH."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        path = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
        env["PYTHONPATH"] = os.pathsep.join(path)
        # this interpreter's scripts (swift, torchrun) first, as in the venv the orchestrator would be installed in
        env["PATH"] = os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")])
        return env | extra

    def orchestrator(self, *args: str) -> list[str]:
        """The orchestrator's command line, run from the source tree."""
        return [self.python, "-m", "orchestrator", *args]

    def missing(self, need: str) -> str | None:
        """Why `need` is not available here, or None when it is."""
        if need not in self.cache:
            self.cache[need] = NEEDS[need]()
        return self.cache[need]


def _no_cuda() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no CUDA device (nvidia-smi not found)"
    try:
        listed = procs.smi(["-L"]).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"no CUDA device (nvidia-smi -L failed: {e})"
    return None if listed.startswith("GPU ") else f"no CUDA device (nvidia-smi -L: {listed[:200]!r})"


def _no_module(module: str, what: str) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{what} not installed (carry it: python bench/gpu/prepare.py)"
    return check


def _no_swift() -> str | None:
    return _no_module("swift", "ms-swift")() or (None if shutil.which("swift") else "ms-swift's `swift` not on PATH")


NEEDS: dict[str, Callable[[], str | None]] = {
    "cuda": _no_cuda, "swift": _no_swift, "fla": _no_module("fla", "flash-linear-attention"),
    "megatron": _no_module("megatron.core", "megatron-core"),
}


def last_json(text: str) -> dict:
    """The last JSON object in `text` that starts a line (a command's --json answer among its other output,
    on one line or indented over many)."""
    decoder, found, pos = json.JSONDecoder(), None, 0
    while (at := text.find("{", pos)) != -1:
        if at == 0 or text[at - 1] == "\n":
            try:
                found, end = decoder.raw_decode(text, at)
                pos = end
                continue
            except ValueError:
                pass
        pos = at + 1
    if not isinstance(found, dict):
        raise Failed(f"no JSON line in the output:\n{text}")
    return found
