"""What people put around a training command to start it from a shell, read through and listed: wrappers in front
of it (`nohup`, `setsid`, `nice` / `ionice`, `time`, `stdbuf`, `env NAME=value`, `exec`, `taskset`, `numactl`,
`timeout`, `srun`, `mpirun -np N`), each with its options, and redirections (`> train.log`, `2>&1`); the
pipe after it (`| tee -a train.log`) and a trailing `&` are recorded by shell_script. Each is listed as written,
with why the orchestrator does not need it (`why_dropped`). Pure and stdlib-only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
REDIRECT = re.compile(r"^\d*(>>?|<|>&|&>>?|>\|)(.*)$")
# where the orchestrator writes each attempt's trainer output (store/rundir.py)
LOGS = "<run.output_dir>/.orchestrator/attempts/attempt-NNNN.log"


@dataclass(frozen=True)
class _Spec:
    """A wrapper's options: those taking one value, two values, none; `other` how many an unlisted option takes;
    `positional` how many words after the options are its own (a duration, a CPU mask)."""

    valued: frozenset[str] = frozenset()
    pairs: frozenset[str] = frozenset()
    bare: frozenset[str] = frozenset()
    other: int = 0
    positional: int = 0


def _s(words: str) -> frozenset[str]:
    return frozenset(words.split())


_SPECS = {
    "nohup": _Spec(), "setsid": _Spec(), "command": _Spec(),
    "nice": _Spec(valued=_s("-n --adjustment")),
    "ionice": _Spec(valued=_s("-c --class -n --classdata -p --pid -P --pgid -u --uid")),
    "stdbuf": _Spec(valued=_s("-i -o -e --input --output --error")),
    "time": _Spec(valued=_s("-f --format -o --output")),
    "exec": _Spec(valued=_s("-a")),
    "env": _Spec(valued=_s("-u --unset -C --chdir -S --split-string")),
    "taskset": _Spec(positional=1),  # taskset [-c] MASK-or-LIST COMMAND
    "numactl": _Spec(valued=_s("-N -m -C -i -p --cpunodebind --membind --physcpubind --interleave --preferred")),
    "timeout": _Spec(valued=_s("-s --signal -k --kill-after"), positional=1),  # timeout DURATION COMMAND
    "srun": _Spec(bare=_s("-l --label -u --unbuffered --exclusive --pty -K -k --no-kill -Q --quiet -v --verbose -O "
                          "--overcommit -s --oversubscribe -X --disable-status -E --preserve-env -Z --no-allocate"),
                  other=1),
    "mpirun": _Spec(pairs=_s("-mca --mca -gmca --gmca -genv -env"),
                    bare=_s("--allow-run-as-root -allow-run-as-root --oversubscribe -oversubscribe --tag-output "
                            "-tag-output --report-bindings -report-bindings --display-map -display-map -v --verbose "
                            "-q --quiet"), other=1),
}
_SPECS["mpiexec"] = _SPECS["mpirun"]
_ASSIGNING = {"env", "time"}  # after these, NAME=value words are the command's environment (as bash reads them)


@dataclass(frozen=True)
class Launch:
    """A command with what wraps it taken off: `words` the command itself, `env` the assignments given through
    `env` / `time` (or mpirun's `-x NAME=value`), `wrappers` each wrapper with its options as written
    ("nohup", "nice -n 10", "mpirun -np 8"), `redirections` as written ("> train.log", "2>&1")."""

    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    wrappers: tuple[str, ...] = ()
    redirections: tuple[str, ...] = ()


def _options(spec: _Spec, rest: list[str]) -> int:
    """How many words of `rest` are the wrapper's own options and positional arguments."""
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-":
        opt = rest[i]
        i += 1
        if opt == "--":
            break
        key = opt.split("=", 1)[0]
        if "=" in opt or (not opt.startswith("--") and len(opt) > 2 and opt[:2] in spec.valued):
            continue  # --output=L, -oL, -n10: the value is attached
        if re.fullmatch(r"-\d+", opt):  # nice -10 (the old spelling)
            continue
        i += 1 if key in spec.valued else 2 if key in spec.pairs else 0 if key in spec.bare else spec.other
    return min(len(rest), i + spec.positional)


def _redirections(words: list[str]) -> tuple[list[str], list[str]]:
    """The words without their redirections, and the redirections as written."""
    kept: list[str] = []
    found: list[str] = []
    i = 0
    while i < len(words):
        m = REDIRECT.match(words[i])
        if m:
            target = m.group(2) or (words[i + 1] if i + 1 < len(words) else "")
            found.append(words[i] if m.group(2) else f"{words[i]} {target}".rstrip())
            i += 1 if m.group(2) else 2
            continue
        kept.append(words[i])
        i += 1
    return kept, found


def read_launch(words: tuple[str, ...] | list[str]) -> Launch:
    """Takes the wrappers off the front of `words` (as many as there are, in any order) and the redirections out
    of them."""
    rest, redirections = _redirections(list(words))
    env: dict[str, str] = {}
    wrappers: list[str] = []
    while rest and (name := rest[0].rsplit("/", 1)[-1]) in _SPECS:
        n = 1 + _options(_SPECS[name], rest[1:])
        own, rest = rest[:n], rest[n:]
        if name in ("mpirun", "mpiexec"):  # -x NAME=value exports NAME to the processes
            env |= {m.group(1): m.group(2) for a, b in zip(own, own[1:]) if a == "-x" and (m := ASSIGNMENT.fullmatch(b))}
        while name in _ASSIGNING and rest and (m := ASSIGNMENT.fullmatch(rest[0])):
            env[m.group(1)] = m.group(2)
            rest = rest[1:]
        wrappers.append(" ".join(own))
    return Launch(tuple(rest), env, tuple(wrappers), tuple(redirections))


def why_dropped(item: str) -> str:
    """Says why a wrapper, redirection, pipe or `&` around the training command is not in the recipe, and what
    the orchestrator does instead."""
    name = item.split()[0].rsplit("/", 1)[-1] if item.split() else item
    if name in ("nohup", "setsid", "&"):
        return ("the orchestrator keeps the trainer running itself (its own process group, restarted on failure); "
                "run `orchestrator run` in tmux or as a service (`orchestrator install-service`), and its output "
                f"goes to {LOGS}")
    if REDIRECT.match(name) or name in ("|", "|&"):
        return f"the orchestrator keeps the trainer's output itself: {LOGS}, one file per attempt"
    if name == "env":
        return "its NAME=value assignments are read as the command's environment (env.vars)"
    if name == "exec":
        return "the orchestrator starts the trainer as its own child process, so there is nothing to replace"
    if name == "time":
        return "the orchestrator times every attempt itself (`orchestrator history`: each attempt and the goodput)"
    if name == "timeout":
        return ("a multi-day run is not cut off by a timer here: send `orchestrator run` SIGTERM (or SIGINT) to stop it "
                "gracefully")
    if name == "srun":
        return ("the orchestrator launches across nodes itself: for parallel.nnodes > 1, `orchestrator sbatch RECIPE` "
                "writes the Slurm batch script and runs each attempt as one `srun` step (on one node it launches "
                "directly); set parallel.nnodes to the node count")
    if name in ("mpirun", "mpiexec"):
        return ("ms-swift starts one process per GPU through torchrun: the orchestrator sets NPROC_PER_NODE = "
                "parallel.nproc_per_node (and uses Slurm for several nodes); the MPI process count is not read: set "
                "parallel.nproc_per_node to the GPUs per node")
    words = ", ".join(f'"{w}"' for w in item.split())
    return (f"the orchestrator starts the trainer itself; to keep `{name}`, set run.entrypoint = [{words}, "
            "\"swift\"] (or \"megatron\"): the argv that replaces the trainer executable")
