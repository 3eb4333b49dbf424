"""A shell script (or a pasted command) as the commands it runs: continuations joined, comments dropped,
`NAME=value` assignments and `export` applied in order, `$VAR` / `${VAR}` / `${VAR:-default}` expanded,
`$((...))` and `$(expr ...)` integer arithmetic evaluated, quotes removed (shlex). Nothing is executed.

Bad input raises ScriptError naming the line: an unclosed quote. A text that stops right after a `\\` is a
paste cut off (the command is marked so); a last line ending in `\\` before the file's final newline ends the
command there, as bash runs it.
A variable with no value is recorded per command (its `unresolved` names, including those behind the
variables it uses), as is a command substitution (its `problems`), for the caller to decide: only the
command being imported must be fully resolved. Pure and stdlib-only.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace

from orchestrator.config.launch_wrappers import read_launch
from orchestrator.config.shell_expand import NAME, Expander, ScriptError

__all__ = ["NAME", "ASSIGNMENT", "Command", "ScriptError", "commands", "logical_commands"]

ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
_SEPARATORS = (";", "|", "&")
_ARRAY_OPEN = re.compile(r"(^|\s)[A-Za-z_][A-Za-z0-9_]*\+?=$")  # `NAME=(` starts an array
_ARRAY = re.compile(r"(?:(?:export|declare|local|typeset)(?:\s+-\w+)*\s+)?([A-Za-z_][A-Za-z0-9_]*)=\((.*)\)", re.DOTALL)
_SHLEX = {"No closing quotation": "a quote opened here is never closed (the command looks cut off)",
          "No escaped character": "it ends with a `\\` that escapes nothing (the line looks cut off after it)"}
_KEYWORDS = {"then", "do", "else", "{", "(", "!"}  # before a command: not part of it


@dataclass(frozen=True)
class Command:
    """One simple command: `env` its prefix assignments and the exported variables, `words` after them
    (expanded, quotes removed, launch wrappers and redirections taken off), `line` where it starts and `last` where
    it ends, `unresolved` the variables it needed and nothing gave, `launch` what wrapped it as written (wrappers,
    redirections, a pipe after it, a trailing `&`)."""

    words: tuple[str, ...]
    line: int
    env: dict[str, str] = field(default_factory=dict)
    prefix: dict[str, str] = field(default_factory=dict)
    unresolved: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    launch: tuple[str, ...] = ()
    last: int = 0
    why: tuple[str, ...] = ()  # what the script did that import cannot follow, behind `unresolved`


@dataclass(frozen=True)
class _Raw:
    text: str
    line: int
    cut: str = ""  # why the command looks cut off ("" when it does not)
    end: str = ""  # the separator that ended it: "|", "&", ";", "&&", "||" ("" for a newline)
    last: int = 0  # the line it ends on


def logical_commands(script: str) -> list[_Raw]:
    """Split `script` into its simple commands' raw text (quotes kept), joining `\\`-newline and dropping
    comments; a newline, `;`, `&&`, `||`, `|` or `&` ends a command."""
    out: list[_Raw] = []
    buf: list[str] = []
    line, start, quote, quote_line = 1, 1, "", 0
    paren = 0  # inside an array assignment's `(...)` or a `$(...)`, which may span lines and hold `|`
    i, n = 0, len(script)

    def flush(cut: str = "", end: str = "") -> None:
        text = "".join(buf).strip()
        if text:
            out.append(_Raw(text, start, cut, end, line))
        buf.clear()

    while i < n:
        c = script[i]
        if c == "\\" and quote != "'":
            if quote == "" and script[i + 1:] == "\n":
                # a last line ending in `\` then the newline that ends the file: bash runs the command as it
                # stands (ms-swift 2.x's own example scripts all end so), so it ends here
                flush()
                return out
            if quote == "" and i + 1 == n:
                # the text stops right after a `\`, not even its line complete: recorded as cut off, so that the
                # caller can still say what it is (an inference command cut off is refused as inference)
                flush(f"line {line}: the script ends with a line continuation `\\`: the command looks cut off")
                return out
            if i + 1 >= n:
                raise ScriptError(f"line {line}: the script ends inside a {quote} quote with a `\\`: the command "
                                  f"looks cut off")
            if script[i + 1] == "\n":  # a continuation
                line += 1
                i += 2
                continue
            buf.append(script[i:i + 2])
            i += 2
            continue
        if quote:
            if c == quote:
                quote = ""
            elif c == "\n":
                line += 1
            buf.append(c)
            i += 1
            continue
        if c in "'\"":
            quote, quote_line = c, line
            if not "".join(buf).strip():
                start = line
        elif c == "#" and (not buf or buf[-1] in " \t\n;&|("):
            while i < n and script[i] != "\n":
                i += 1
            continue
        elif c == "\n" and paren:
            buf.append(" ")
            line += 1
            i += 1
            continue
        elif c == "(" and (paren or _ARRAY_OPEN.search("".join(buf)) or buf[-1:] == ["$"]):
            paren += 1
        elif c == ")" and paren:
            paren -= 1
        elif c == "\n":
            flush()
            line += 1
            start = line
            i += 1
            continue
        elif c in _SEPARATORS and not paren and not (c == "&" and (buf and buf[-1] in "<>" or script[i + 1:i + 2] == ">")):
            j = i
            while i + 1 < n and script[i + 1] in _SEPARATORS:
                i += 1
            flush(end=script[j:i + 1])
            start = line
            i += 1
            continue
        if not c.isspace() and not "".join(buf).strip():
            start = line
        buf.append(c)
        i += 1
    if quote:
        raise ScriptError(f"line {quote_line}: unclosed {quote} quote (the command looks cut off)")
    flush()
    return out


def _assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The leading `NAME=value` words as a dict, and the words after them."""
    out: dict[str, str] = {}
    while words and (m := ASSIGNMENT.fullmatch(words[0])):
        out[m.group(1)] = m.group(2)
        words = words[1:]
    return out, words


def commands(script: str, given: dict[str, str] | None = None) -> list[Command]:
    """The script's simple commands in order, expanded with the variables assigned before each one;
    `given` (--var NAME=VALUE) wins over the script's own assignments, prefixes included."""
    given = dict(given or {})
    values: dict[str, str] = dict(given)
    taint: dict[str, tuple[str, ...]] = {}
    arrays: dict[str, list[str]] = {}
    exported: dict[str, str] = {}
    why: dict[str, str] = {}  # a variable the script sets from what import does not run or read -> that
    sourced: list[str] = []  # `source FILE` / `. FILE` lines, not read
    out: list[Command] = []
    before: _Raw | None = None  # the raw command before this one, and whether it became out[-1]
    last_out: _Raw | None = None
    for raw in logical_commands(script):
        piped = before is not None and before.end in ("|", "|&") and last_out is before
        before = raw
        ex = Expander(values, taint, raw.line, arrays)
        if raw.cut:
            ex.problems.append(raw.cut)
        if (a := _ARRAY.fullmatch(raw.text)) is not None:  # NAME=(a b c): an array
            name = a.group(1)
            if name not in given:
                arrays[name] = _split(ex, a.group(2), raw.line)
                values[name], taint[name] = (arrays[name] or [""])[0], tuple(ex.unresolved)
            continue
        words = _split(ex, raw.text, raw.line)
        while words and words[0] in _KEYWORDS:
            words = words[1:]
        if words[:1] in (["source"], ["."]):
            sourced.append(f"`{' '.join(words)}` at line {raw.line}")
            continue
        exporting = words[:1] == ["export"] or words[:2] == ["declare", "-x"]
        if exporting:
            words = words[2:] if words[0] == "declare" else words[1:]
        prefix, words = _assignments(words)
        if not exporting and prefix and words[:1] == ["export"]:
            # `A=1 export B=2`: bash exports B and forgets A, which lived only for the `export` builtin
            exporting = True
            prefix, words = _assignments(words[1:])
        unrun = {n: f"${n} is set from {', '.join(_subs(ex, v))} at line {raw.line}, which import does not run"
                 for n, v in prefix.items() if n not in given and _subs(ex, v)}
        if exporting or not words:  # assignments (and `export NAME` of an earlier one)
            for name, value in prefix.items():
                if name not in given:
                    values[name] = value
                    taint[name] = (*ex.unresolved, *([name] if name in unrun else []))
                    why.pop(name, None)
                if name in exported:  # an exported variable assigned again stays exported
                    exported[name] = values[name]
                if exporting:
                    exported[name] = values[name]
            why |= unrun
            if exporting:
                for name in words:
                    if NAME.fullmatch(name) and name in values:
                        exported[name] = values[name]
            continue
        prefix = {n: given.get(n, v) for n, v in prefix.items()}
        launch = read_launch(words)
        if piped:  # `... | tee -a train.log`: listed with the command whose output it takes
            out[-1] = replace(out[-1], launch=(*out[-1].launch, f"| {' '.join(words)}"))
        prefix |= launch.env
        if not launch.words:
            continue
        # an exported variable whose value needed an unset one leaves this command's environment unresolved too
        unresolved = [*ex.unresolved, *[n for v in exported for n in taint.get(v, ())], *unrun]
        unresolved = list(dict.fromkeys(unresolved))
        problems = [*ex.problems, *(f"line {raw.line}: the command substitution {s} is not run here; replace it "
                                    "with its value" for s in _subs(ex, *launch.words))]
        reasons = [(why | unrun)[n] for n in unresolved if n in why | unrun]
        if sourced and any(n not in why | unrun for n in unresolved):
            reasons.append(f"{', '.join(sourced)} is not read, and may set "
                           + ", ".join(f"${n}" for n in unresolved if n not in why | unrun))
        around = (*launch.wrappers, *launch.redirections, *(["&"] if raw.end == "&" else []))
        out.append(Command(launch.words, raw.line, {**exported, **prefix}, prefix, tuple(unresolved),
                           tuple(problems), around, raw.last, tuple(reasons)))
        last_out = raw
    return out


def _split(ex: Expander, text: str, line: int) -> list[str]:
    """`text` expanded and split into words as the shell does; ScriptError naming the line for what shlex cannot
    split, in words a user can act on."""
    try:
        return shlex.split(ex.expand(text))
    except ScriptError:
        raise
    except ValueError as e:
        raise ScriptError(f"line {line}: {_SHLEX.get(str(e), str(e))}") from None


def _subs(ex: Expander, *words: str) -> list[str]:
    """The command substitutions of `ex` that stand in `words` (so that one in a log file's name is not asked
    for), each as written in backticks."""
    return [s if s.startswith("`") else f"`{s}`" for s in dict.fromkeys(ex.substitutions) if any(s in w for w in words)]
