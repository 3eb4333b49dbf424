"""Which command of a script is the training, and in which form: `megatron sft`, `swift sft` (with or without
the fictional `--use_megatron true`), `torchrun ... swift/cli/sft.py`, `python -m swift.cli.sft`,
`accelerate launch ... swift/cli/sft.py`, `deepspeed ... swift/cli/sft.py`, and ms-swift 2.x's
`python llm_sft.py` (its examples' entry point); its launcher's options, and its sft arguments as flags.

A command this tool does not supervise (RLHF, pre-training, inference, export, ...) or one it cannot read
raises ImportRefused with what and where. Pure.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from orchestrator.config.shell_script import Command


class ImportRefused(ValueError):
    """Bad input for `orchestrator import` (exit 2); one line per problem."""

    def __init__(self, problems: list[str], unresolved: tuple[str, ...] = ()):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.unresolved = unresolved


@dataclass(frozen=True)
class Flag:
    """One sft flag as given: `name` normalised (no dashes in front, `-` as `_`), `written` as typed,
    `values` the words after it (none: a bare flag, which ms-swift reads as true)."""

    name: str
    written: str
    values: tuple[str, ...]
    line: int

    @property
    def text(self) -> str:
        return " ".join((self.written, *self.values))


@dataclass(frozen=True)
class Training:
    """The training command: its backend (by command form), its sft flags, its launcher's options as
    (option, value) pairs, its environment (prefix and exported variables) and where it starts."""

    backend: str
    form: str
    flags: tuple[Flag, ...]
    env: dict[str, str]
    line: int
    launcher: tuple[tuple[str, str], ...] = ()
    others: tuple[str, ...] = field(default=())  # the script's other ms-swift commands, ignored
    launch: tuple[str, ...] = ()  # wrappers, redirections, a pipe and `&` around it, as written (launch_wrappers)
    notes: tuple[str, ...] = ()  # how the command was read where the text alone did not say


_SUB = {"sft": "sft", "pt": "pre-training (`pt`)", "rlhf": "RLHF (`rlhf`)", "infer": "inference (`infer`)",
        "export": "export (`export`)", "deploy": "deployment (`deploy`)", "eval": "evaluation (`eval`)",
        "sample": "sampling (`sample`)", "rollout": "rollout (`rollout`)", "app": "an app (`app`)",
        "web-ui": "the web UI (`web-ui`)", "merge-lora": "a LoRA merge (`merge-lora`)",
        # ms-swift 2.x's preference-training subcommands (3.x and later: `swift rlhf --rlhf_type NAME`)
        **{k: f"RLHF (2.x `{k}`; since 3.0 `swift rlhf --rlhf_type {k}`)" for k in ("dpo", "orpo", "simpo", "kto", "cpo")}}
# programs that start the training script on each GPU (torch's and DeepSpeed's launchers), like `torchrun`
_LAUNCHERS = {"torchrun", "deepspeed"}
# environment managers whose `run` subcommand runs the command after it (`uv run`, `conda run -n env`), and their
# options that take a value
_RUNNERS = {"uv", "conda", "mamba", "micromamba", "poetry", "pipenv", "pixi"}
_RUNNER_VALUED = {"-n", "--name", "-p", "--prefix", "--python", "--with", "--project", "--directory", "--env",
                  "--environment", "-e", "--manifest-path"}
_PYTHON = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")
_SCRIPT = re.compile(r"(^|/)swift/cli/(_megatron/)?([a-z_]+)\.py$")
# ms-swift 2.x's example entry points (examples/pytorch/llm/llm_sft.py: `from swift.llm import sft_main`)
_V2_SCRIPT = re.compile(r"(^|/)llm_([a-z]+)\.py$")
_MODULE = re.compile(r"^swift\.cli\.(_megatron\.)?([a-z_]+)$")
# torchrun options without a value (torch.distributed.run's store_true options)
_TORCHRUN_BARE = {"standalone", "no_python", "run_path", "module", "m", "tee_stdout"}
_DEEPSPEED_BARE = {"no_python", "module", "no_local_rank", "force_multi", "elastic_training", "bind_cores_to_rank",
                   "no_ssh_check", "no_ssh", "enable_each_rank_log"}
_ACCELERATE_BARE = {"multi_gpu", "use_deepspeed", "use_fsdp", "cpu", "mixed_precision_no", "debug"}


def _where(c: Command) -> str:
    return f"line {c.line}"


def _launched(words: tuple[str, ...]) -> tuple[str, str, str, tuple[tuple[str, str], ...], tuple[str, ...]] | None:
    """(program, subcommand, backend, launcher options, sft argv) of a command that runs ms-swift, else None."""
    if not words:
        return None
    prog = words[0].rsplit("/", 1)[-1]
    if prog in ("swift", "megatron"):
        sub = words[1] if len(words) > 1 else ""
        return prog, sub, prog, (), words[2:]
    launcher: list[tuple[str, str]] = []
    rest = list(words[1:])
    if prog == "env":
        while rest and "=" in rest[0]:
            rest = rest[1:]
        return _launched(tuple(rest))
    if prog in _RUNNERS and rest[:1] == ["run"]:  # `uv run torchrun ...`: the environment manager runs the rest
        rest = rest[1:]
        while rest and rest[0].startswith("-"):
            opt = rest.pop(0)
            if opt in _RUNNER_VALUED and rest:
                rest.pop(0)
        return _launched(tuple(rest))
    python = bool(_PYTHON.match(words[0]))
    if python and rest[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        prog, rest = "torchrun", rest[2:]
    if python and rest[:1] == ["-m"] and len(rest) > 1:
        m = _MODULE.match(rest[1])
        if not m:
            return None
        if m.group(2) == "main":  # python -m swift.cli.main sft ...: the subcommand follows
            return "python -m", rest[2] if len(rest) > 2 else "", "megatron" if m.group(1) else "swift", (), \
                tuple(rest[3:])
        return "python -m", m.group(2), "megatron" if m.group(1) else "swift", (), tuple(rest[2:])
    form = "python"
    if prog in _LAUNCHERS or (prog == "accelerate" and rest[:1] == ["launch"]):
        form = prog if prog in _LAUNCHERS else "accelerate launch"
        if prog == "accelerate":
            rest = rest[1:]
        bare = {"torchrun": _TORCHRUN_BARE, "deepspeed": _DEEPSPEED_BARE}.get(prog, _ACCELERATE_BARE)
        while rest and rest[0].startswith("-"):
            opt, eq, val = rest.pop(0).partition("=")
            name = opt.lstrip("-").replace("-", "_")
            if not eq and name not in bare and rest:
                val = rest.pop(0)
            launcher.append((name, val if (eq or name not in bare) else "true"))
        python = True
        if rest and _PYTHON.match(rest[0]):
            rest = rest[1:]
    elif python:
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
    if not python or not rest:
        return None
    m = _SCRIPT.search(rest[0])
    if not m:
        v2 = _V2_SCRIPT.search(rest[0])
        return None if v2 is None else (form, v2.group(2), "swift", tuple(launcher), tuple(rest[1:]))
    return form, m.group(3), "megatron" if m.group(2) else "swift", tuple(launcher), tuple(rest[1:])


def find_training(cmds: list[Command]) -> tuple[Training, Command]:
    """The one sft command of the script (and the Command it came from); ImportRefused otherwise."""
    found: list[tuple[Command, tuple]] = []
    others: list[str] = []
    for c in cmds:
        got = _launched(c.words)
        if got is None:
            continue
        if got[1] == "sft":
            found.append((c, got))
        else:
            others.append(f"{_where(c)}: {' '.join(c.words[:2])}")
    if not found:
        if others:
            first = cmds[next(i for i, c in enumerate(cmds) if _launched(c.words))]
            prog, sub, backend, _, _ = _launched(first.words)  # type: ignore[misc]
            what = _SUB.get(sub, f"`{sub}`" if sub else "no subcommand")
            raise ImportRefused([(f"{_where(first)}: `{backend} {sub}` is {what}, not a `megatron sft` / `swift sft` "
                                 f"run: this tool supervises LoRA fine-tunes (sft) only")])
        raise ImportRefused([("no `megatron sft` or `swift sft` command found (also looked for torchrun / python / "
                             "accelerate launching swift/cli/sft.py)")])
    if len(found) > 1:
        raise ImportRefused([(f"{len(found)} sft commands (lines {', '.join(str(c.line) for c, _ in found)}): import "
                             f"one at a time (save each as its own script)")])
    c, (prog, _sub, backend, launcher, argv) = found[0]
    c, notes = _rejoined(c, cmds)
    argv = (*argv, *c.words[len(found[0][0].words):])
    if c.problems:
        raise ImportRefused(list(c.problems))
    _continued(c, cmds)
    if c.unresolved:
        names = ", ".join(f"${n}" for n in c.unresolved)
        why = f" ({'; '.join(c.why)})" if c.why else ""
        raise ImportRefused([f"{_where(c)}: no value for {names}{why}: give each with --var NAME=VALUE (e.g. "
                             f"--var {c.unresolved[0]}=...)"], unresolved=c.unresolved)
    return Training(backend, f"{prog} sft", parse_flags(argv, c), dict(c.env), c.line, launcher,
                    tuple(others), c.launch, notes), c


def _rejoined(c: Command, cmds: list[Command]) -> tuple[Command, tuple[str, ...]]:
    """The training command with the lines after it that each start with `--` joined on, when it stands on one
    line and so does each of them: a paste that lost all its `\\` continuations (copied from a web page or a chat),
    which has one reading; with a note saying so. A command that kept some continuations is left as it is."""
    i = cmds.index(c) + 1
    j = i
    while j < len(cmds) and cmds[j].words[:1] and cmds[j].words[0].startswith("--") and not cmds[j].prefix \
            and cmds[j].line == cmds[j].last and c.line == c.last:
        j += 1
    if j == i:
        return c, ()
    rest = cmds[i:j]
    joined = replace(c, words=c.words + tuple(w for r in rest for w in r.words), last=rest[-1].last,
                     unresolved=tuple(dict.fromkeys(c.unresolved + tuple(n for r in rest for n in r.unresolved))),
                     problems=c.problems + tuple(p for r in rest for p in r.problems),
                     launch=c.launch + tuple(x for r in rest for x in r.launch), why=c.why + tuple(
                         w for r in rest for w in r.why if w not in c.why))
    cmds[i - 1:j] = [joined]
    return joined, (f"lines {c.line + 1}-{rest[-1].last} each start with `--` and none of lines {c.line}-"
                    f"{rest[-1].last - 1} ends with `\\`: read as one command (a paste that lost its line "
                    "continuations); bash would run each line as a command of its own",)


def _continued(c: Command, cmds: list[Command]) -> None:
    """ImportRefused when the command after the training one starts with a flag: a line of the training command
    lost its `\\` (or has a comment after it), so bash runs the flags below it as a command of their own."""
    i = cmds.index(c) + 1
    nxt = cmds[i] if i < len(cmds) else None
    if nxt and nxt.words and nxt.words[0].startswith("-") and not nxt.prefix:
        n = nxt.line
        raise ImportRefused([(f"line {n}: `{nxt.words[0]}` starts a command of its own: the line before it does "
                              f"not end with `\\` (a comment after a `\\` ends the line too), so the command at line "
                              f"{c.line} stops there and bash runs the flags from line {n} on apart; add the `\\`")])


def parse_flags(argv: tuple[str, ...], c: Command) -> tuple[Flag, ...]:
    """`--name v ...` / `--name=v` words as Flags (shell_script took the redirections off); ImportRefused for a
    positional word before the first flag (a config file) and for a paste cut off mid-flag."""
    out: list[Flag] = []
    for w in argv:
        if w and not w.strip():
            raise ImportRefused([(f"{_where(c)}: a `\\` followed by a space, not by the end of the line: bash passes a "
                                  "lone space as an argument, which ms-swift rejects; a multi-line command pasted onto "
                                  "one line keeps its `\\`s (remove them), and a comment after a `\\` ends the command")])
        if w.startswith("--") and len(w) > 2:
            name, eq, value = w.partition("=")
            out.append(Flag(name[2:].replace("-", "_"), name, (value,) if eq else (), c.line))
        elif not out:
            raise ImportRefused([(f"{_where(c)}: `{w}` before the first flag: a config file (`sft config.yaml`) is "
                                 f"not read by import; write its keys as --flags")])
        else:
            last = out[-1]
            out[-1] = Flag(last.name, last.written, (*last.values, w), last.line)
    return tuple(out)
