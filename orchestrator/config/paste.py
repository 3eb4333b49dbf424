"""A command as people paste it (from a GitHub issue, a chat, a Windows editor) back to the shell text it wraps:
Windows line endings made Unix ones, Markdown code fences (```, ```bash, a fence glued to the first command),
a pair of single backticks around the whole paste and shell prompts (`$ `, `(env) user@host:~/dir$ `) removed.
Line numbers are kept (a removed fence leaves an empty line), so errors still name the line of the original.

A fence that is opened and never closed means the paste ends before its command does, and a PowerShell script
(`$env:NAME=`, backtick line ends) is not bash: ScriptError says so.
Pure and stdlib-only.
"""
from __future__ import annotations

import re

from orchestrator.config.shell_script import ScriptError

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*[\w+.-]*\s*$")  # a fence line, with or without a language tag
_GLUED_OPEN = re.compile(r"^\s*```+(?=[^`\s])")  # "```export PATH=..." : the fence and the first line in one
_GLUED_CLOSE = re.compile(r"(?<=[^`\s])```+\s*$")  # "... --x 1```"
# PowerShell, which import does not read: `$env:NAME = value`, and lines continued with a backtick after a space
_PS_ENV = re.compile(r"^\s*\$env:\w+\s*=", re.MULTILINE)
_PS_CONTINUED = re.compile(r"^[ \t]*\S.*[ \t]`[ \t]*$", re.MULTILINE)
# An interactive prompt copied with the command: no shell line starts with "$ " (a parameter needs a name).
_PROMPT = re.compile(r"^\s*(?:\([\w.-]+\)\s*)?(?:[\w.-]+@[\w.-]+(?::[^\s$]*)?)?\$\s+(?=\S)", re.MULTILINE)


def _inline_wrapped(text: str) -> bool:
    """Whether the paste is `...` as a whole: Markdown inline code around a command, the only two backticks
    in it (a command substitution has its own pair inside, so two in all means none)."""
    s = text.strip()
    return len(s) > 2 and s[0] == s[-1] == "`" and not s.startswith("``") and s.count("`") == 2


def _not_powershell(text: str) -> None:
    """Raises ScriptError for a PowerShell script (a Windows user's command): its `$env:` assignments and
    backtick line ends mean nothing to bash, and read as bash they turn into half a command."""
    env = _PS_ENV.search(text)
    continued = _PS_CONTINUED.findall(text)
    if env or len(continued) >= 2:
        at = env.start() if env else text.index(continued[0])
        n = text.count("\n", 0, at) + 1
        raise ScriptError(f"line {n}: a PowerShell script (`$env:NAME=` assignments, lines continued with a backtick): "
                          "import reads bash; write it as bash (`NAME=value` before the command, lines ending in `\\`)")


def unwrap(text: str) -> str:
    """The shell text inside a pasted command; ScriptError for a fence that is never closed (a cut-off paste)."""
    text = _PROMPT.sub("", text.replace("\r\n", "\n"))
    _not_powershell(text)
    if "`" not in text and "~~~" not in text:
        return text
    out: list[str] = []
    opened = 0  # the line of the fence now open, 0 when none is
    for n, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            opened = 0 if opened else n
            # a blank line for the fence (a space for a closing one: a `\` just before it then ends its command
            # there, as the paste does, instead of running into the end of the script)
            out.append("" if opened else " ")
            continue
        glued = _GLUED_OPEN.match(line)
        if glued and not opened:
            opened, line = n, line[glued.end():]
        elif opened and _GLUED_CLOSE.search(line):
            opened, line = 0, _GLUED_CLOSE.sub("", line)
        out.append(line)
    if opened:
        raise ScriptError(f"line {opened}: the ``` code fence opened here is never closed: the paste looks cut off "
                          "before the end of its command; paste the whole command")
    body = "\n".join(out)
    if _inline_wrapped(body):
        first, last = body.index("`"), body.rindex("`")
        body = body[:first] + " " + body[first + 1:last] + " " + body[last + 1:]
    return body
