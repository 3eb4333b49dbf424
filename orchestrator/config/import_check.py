"""The import's round trip as a check: every flag and variable of the original command reaches the rendered
command (argv and environment) with the same value under its 4.x name, unless the report drops it with a
reason. Pure; `orchestrator import` runs it on every recipe it writes, and the tests on ms-swift's examples."""
from __future__ import annotations

import math
from pathlib import Path

from orchestrator.config import flags as F
from orchestrator.config.command_form import Training
from orchestrator.config.import_env import COUNT_VARS, LAUNCHER_COUNTS
from orchestrator.config.importer import Imported

_PATHS = {"model", "output_dir", "dataset", "val_dataset", "mcore_model"}  # those the recipe resolves


def rendered_values(argv: list[str] | tuple[str, ...], name: str) -> tuple[str, ...] | None:
    """The words after the last `--name` of `argv` up to the next flag; None if it is not there."""
    flag = f"--{name}"
    if flag not in argv:
        return None
    i = len(argv) - 1 - list(reversed(argv)).index(flag)
    out = []
    for w in argv[i + 1:]:
        if w.startswith("--") and len(w) > 2:
            break
        out.append(w)
    return tuple(out)


def _word_equal(a: str, b: str) -> bool:
    if a == b or a.lower() == b.lower() in ("true", "false"):
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0)


def same_value(name: str, given: tuple[str, ...], rendered: tuple[str, ...], recipe_dir: Path) -> bool:
    """Whether `rendered` carries `given`: a bare flag is true, numbers by value, relative paths as the recipe
    resolves them (against its own directory)."""
    given = given or ("true",)
    if len(given) != len(rendered):
        return False
    for a, b in zip(given, rendered):
        if _word_equal(a, b):
            continue
        if name in _PATHS and not Path(a).is_absolute() and str((recipe_dir / a).resolve()) == b:
            continue
        return False
    return True


def count_carried(name: str, value: str, env: dict[str, str]) -> bool:
    """Says whether the rendered environment carries the process or node count `name`=`value`: by number, and
    an absent variable as 1, since the renderer sets NPROC_PER_NODE only for several processes (or Megatron) and
    NNODES only for several nodes: `NPROC_PER_NODE=1 swift sft` runs as plain `swift sft`, one process either way."""
    try:
        want = int(value)
    except ValueError:
        return False
    got = env.get(name)
    return want == 1 if got is None else got.strip().isdigit() and int(got) == want


def round_trip_problems(t: Training, imported: Imported, argv: list[str] | tuple[str, ...], env: dict[str, str],
                        recipe_dir: Path) -> list[str]:
    """What of the original command the rendered one lost or changed without a dropped entry saying why."""
    backend = imported.recipe["run"]["backend"]
    dropped = {(d["flag"], d["value"]) for d in imported.dropped}
    out = []
    for f in t.flags:
        if (f.written, " ".join(f.values)) in dropped:
            continue
        name = F.RENAMED[backend].get(f.name, f.name)
        got = rendered_values(argv, name)
        if got is None or not same_value(name, f.values, got, recipe_dir):
            out.append(f"{f.text}: rendered as " + ("nothing" if got is None else " ".join((f"--{name}", *got))))
    for name, value in t.env.items():
        if (name, value) in dropped or (name in COUNT_VARS and count_carried(name, value, env)):
            continue
        if env.get(name) != value:
            out.append(f"{name}={value}: rendered as {env.get(name)!r}")
    launcher = t.form.removesuffix(" sft")
    for opt, value in t.launcher:
        if (f"{launcher} --{opt}", value) in dropped:
            continue
        var = LAUNCHER_COUNTS[opt][0] if opt in LAUNCHER_COUNTS else None
        if var is None or not count_carried(var, value, env):
            out.append(f"{launcher} --{opt} {value}: rendered as {var}={env.get(var or '')!r}")
    return out
