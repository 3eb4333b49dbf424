"""`orchestrator import`'s reading of a command's environment and launcher: `NPROC_PER_NODE` / `NNODES` and the
launchers' process counts (torchrun, accelerate, DeepSpeed's `deepspeed`) become parallel.*, the variables the
orchestrator sets at each launch are dropped with the reason, and every other variable goes to env.vars. Pure.
"""
from __future__ import annotations

import typing

from orchestrator.config import flags as F
from orchestrator.config.command_form import ImportRefused, Training
from orchestrator.config.import_values import convert


class Imported(typing.Protocol):
    """Names what of importer.Imported this module writes to (importer imports this module, so it cannot import
    the class)."""

    recipe: dict
    mapped: list[dict]
    notes: list[str]

    def drop(self, flag: str, value: str, reason: str) -> None: ...

    def set(self, key: str, value: object) -> None: ...


OWNED_ENV = {"CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}
_LAUNCH_WHY = ("set by the orchestrator at each launch (a free port from supervisor.port_range; several nodes: "
               "Slurm, parallel.nnodes)")
# launcher option -> the variable and recipe key it sets (torchrun, accelerate launch, deepspeed)
_PROCESSES, _NODES = ("NPROC_PER_NODE", "parallel.nproc_per_node"), ("NNODES", "parallel.nnodes")
LAUNCHER_COUNTS = {"nproc_per_node": _PROCESSES, "num_processes": _PROCESSES, "num_gpus": _PROCESSES,
                   "num_accelerators": _PROCESSES, "nnodes": _NODES, "num_machines": _NODES, "num_nodes": _NODES}
_COUNT_KEYS = dict((_PROCESSES, _NODES))   # the variables with the same meaning: variable -> recipe key
COUNT_VARS = frozenset(_COUNT_KEYS)
_RENDEZVOUS = {"node_rank", "machine_rank", "master_addr", "master_port", "main_process_ip", "main_process_port"}
# launcher options that point at a file (or host list) holding the layout, which import does not open
_ELSEWHERE = {"config_file": "the launch configuration in it (processes, machines, FSDP / DeepSpeed settings)",
              "hostfile": "the hosts and GPUs per host listed in it",
              "include": "the hosts and GPUs it selects", "exclude": "the hosts and GPUs it leaves out"}


def _pythonpath(value: str) -> str | None:
    """Says why a PYTHONPATH cannot be carried (a relative entry: the orchestrator launches from elsewhere);
    returns None when it can."""
    relative = [p for p in value.split(":") if p and not p.startswith(("/", "~", "$"))]
    if not relative:
        return None
    return (f"{', '.join(relative)} is relative to the directory the script ran from (ms-swift 2.x's examples "
            "point it at their checkout), which the orchestrator's launch does not share: set env.vars.PYTHONPATH "
            "to absolute paths if the run needs them")


def _count(what: str, value: str, t: Training) -> int:
    """The process or node count `what` gives; ImportRefused naming the line when it is not a whole number."""
    try:
        return int(convert((value,), int))  # type: ignore[call-overload]
    except ValueError as e:
        raise ImportRefused([f"line {t.line}: {what}={value}: {e} (a process or node count); set it to the number "
                             "you mean, or leave it out for one"]) from None


def unset_count(name: str, backend: str, parallel: dict) -> str | None:
    """Says why the launch leaves the count variable `name` unset for a count of 1, or returns None when it is set
    (the renderer's rule: NPROC_PER_NODE for several processes, several nodes or Megatron; NNODES for several
    nodes)."""
    if name == "NNODES":
        return None if parallel.get("nnodes", 1) > 1 else ("one node; the orchestrator sets NNODES at launch only for "
                                                            "several nodes")
    if backend == "megatron" or parallel.get("nproc_per_node", 1) > 1 or parallel.get("nnodes", 1) > 1:
        return None
    return ("one process; the orchestrator launches `swift sft` without NPROC_PER_NODE (ms-swift then runs it "
            "directly rather than under torchrun with one process: the same training)")


def environment(out: Imported, t: Training) -> None:
    """Maps the command's environment and its launcher's options to recipe keys and env.vars, or drops them with
    the reason."""
    for name, value in t.env.items():
        if name in _COUNT_KEYS:
            out.set(_COUNT_KEYS[name], _count(name, value, t))
            out.mapped.append({"flag": name, "value": value, "key": _COUNT_KEYS[name]})
        elif name in OWNED_ENV - {"CUDA_VISIBLE_DEVICES"}:
            out.drop(name, value, _LAUNCH_WHY)
        elif name == "CUDA_VISIBLE_DEVICES" and not value.strip():
            out.drop(name, value, "empty: it would hide every GPU; the orchestrator launches on the GPUs it has "
                                  "verified clear (env.vars.CUDA_VISIBLE_DEVICES to pin some)")
        elif name == "PYTHONPATH" and (why := _pythonpath(value)):
            out.drop(name, value, why)
        else:  # CUDA_VISIBLE_DEVICES too: the GPUs the orchestrator verifies clear before each launch
            out.set(f"env.vars.{name}", value)
            out.mapped.append({"flag": name, "value": value, "key": f"env.vars.{name}"})
    for name in [n for n in _COUNT_KEYS if n in t.env]:  # after the loop: the note depends on both counts
        if (why := unset_count(name, out.recipe["run"]["backend"], out.recipe["parallel"])) is not None:
            out.notes.append(f"{name}={t.env[name]} -> {_COUNT_KEYS[name]} = 1: {why}")
    launcher = t.form.removesuffix(" sft")
    for opt, value in t.launcher:
        flag = f"{launcher} --{opt}"
        var, key = LAUNCHER_COUNTS.get(opt, ("", ""))
        if var and var in t.env:
            out.drop(flag, value, f"{var}={t.env[var]} is given too and sets {key}")
        elif var:
            out.set(key, _count(flag, value, t))
            out.mapped.append({"flag": flag, "value": value, "key": key})
        elif opt in _RENDEZVOUS or opt.startswith("rdzv"):
            out.drop(flag, value, _LAUNCH_WHY)
        elif opt in _ELSEWHERE:
            out.drop(flag, value, f"{_ELSEWHERE[opt]} is not read by import: set parallel.nproc_per_node and "
                                  "parallel.nnodes (and extra_args.deepspeed or extra_args.fsdp) to what it says")
        else:
            out.drop(flag, value, f"an option of `{launcher}`: the orchestrator launches the trainer itself "
                                  f"(`{F.COMMAND[out.recipe['run']['backend']]}` with NPROC_PER_NODE)")


def default_processes(out: Imported, t: Training, backend: str) -> None:
    """Sets parallel.nproc_per_node when the command gave no count: to what ms-swift would start, or to one
    process with a note saying where the launcher kept its count."""
    if "nproc_per_node" in out.recipe.get("parallel", {}):
        return
    visible = t.env.get("CUDA_VISIBLE_DEVICES", "")
    n = len([d for d in visible.split(",") if d.strip()]) if backend == "megatron" else 1
    out.set("parallel.nproc_per_node", n or 8)
    launcher = t.form.removesuffix(" sft")
    if backend == "swift" and t.form not in ("swift sft", "python -m sft", "python sft"):
        why = (f"`{launcher}` gave no process count that import reads"
               + (" (its config file or hostfile is not read)" if t.launcher else "") + ": set it to the GPUs per node")
    elif backend == "swift":
        why = "one process, as `swift sft` runs without NPROC_PER_NODE"
    else:
        why = "the GPUs CUDA_VISIBLE_DEVICES names" if n else "the recipe's default (the command did not say)"
    out.notes.append(f"parallel.nproc_per_node = {n or 8}: {why}")
