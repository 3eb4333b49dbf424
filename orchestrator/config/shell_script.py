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
from dataclasses import dataclass, field

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
_SEPARATORS = (";", "|", "&")
_WRAPPERS = {"nohup", "exec", "time", "then", "do", "else", "{", "(", "!"}


class ScriptError(ValueError):
    """The script cannot be read as shell commands; the message names the line."""


@dataclass(frozen=True)
class Command:
    """One simple command: `env` its prefix assignments and the exported variables, `words` after them
    (expanded, quotes removed), `line` where it starts, `unresolved` the variables it needed and nothing gave."""

    words: tuple[str, ...]
    line: int
    env: dict[str, str] = field(default_factory=dict)
    prefix: dict[str, str] = field(default_factory=dict)
    unresolved: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Raw:
    text: str
    line: int
    cut: str = ""  # why the command looks cut off ("" when it does not)


def logical_commands(script: str) -> list[_Raw]:
    """Split `script` into its simple commands' raw text (quotes kept), joining `\\`-newline and dropping
    comments; a newline, `;`, `&&`, `||`, `|` or `&` ends a command."""
    out: list[_Raw] = []
    buf: list[str] = []
    line, start, quote, quote_line = 1, 1, "", 0
    i, n = 0, len(script)

    def flush(cut: str = "") -> None:
        text = "".join(buf).strip()
        if text:
            out.append(_Raw(text, start, cut))
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
        elif c == "\n":
            flush()
            line += 1
            start = line
            i += 1
            continue
        elif c in _SEPARATORS and not (c == "&" and (buf and buf[-1] in "<>" or script[i + 1:i + 2] == ">")):
            flush()
            while i + 1 < n and script[i + 1] in _SEPARATORS:
                i += 1
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


# --- expansion -------------------------------------------------------------------------------------

_ARITH = re.compile(r"^[0-9+\-*/%() \t]*$")


def _arithmetic(expr: str, line: int) -> str:
    """Integer arithmetic of `$((...))` / `expr`: + - * / % and parentheses, / truncating as the shell does."""
    if not _ARITH.match(expr) or not expr.strip() or "**" in expr:  # no powers: 9**9**9 never ends
        raise ScriptError(f"line {line}: cannot evaluate {expr.strip()!r} (only integer + - * / % are read)")
    py = re.sub(r"(?<![/])/(?![/])", "//", expr)
    try:
        value = eval(py, {"__builtins__": {}}, {})
    except (SyntaxError, ZeroDivisionError, TypeError) as e:
        raise ScriptError(f"line {line}: cannot evaluate {expr.strip()!r} ({e})") from None
    return str(int(value))


def _closing(text: str, i: int, open_: str, close: str) -> int:
    """The index just past the `close` that balances the `open_` at text[i - 1]."""
    depth = 1
    while i < len(text):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


class _Expander:
    """`$...` in one raw command, given the variables so far: the text with values inserted (quoted so that
    shlex splits it as the shell would) and the names that had no value."""

    def __init__(self, values: dict[str, str], taint: dict[str, tuple[str, ...]], line: int):
        self.values, self.taint, self.line = values, taint, line
        self.unresolved: list[str] = []
        self.problems: list[str] = []  # what cannot be expanded here (a command substitution)

    def lookup(self, name: str, default: str | None = None) -> str:
        if name in self.values:
            self.unresolved += [n for n in self.taint.get(name, ()) if n not in self.unresolved]
            return self.values[name]
        if default is not None:
            return default
        if name not in self.unresolved:
            self.unresolved.append(name)
        return ""

    def expand(self, text: str) -> str:
        out: list[str] = []
        quote, i = "", 0
        while i < len(text):
            c = text[i]
            if c == "\\" and quote != "'":
                out.append(text[i:i + 2])
                i += 2
                continue
            if c == "'" and quote != '"':
                quote = "" if quote == "'" else "'"
            elif c == '"' and quote != "'":
                quote = "" if quote == '"' else '"'
            elif c == "`" and quote != "'":
                end = text.find("`", i + 1)
                self.problems.append(f"line {self.line}: the command substitution {text[i:end + 1 or None]!r} is "
                                     f"not run here; replace it with its value")
                i = len(text) if end < 0 else end + 1
                continue
            elif c == "$" and quote != "'" and i + 1 < len(text):
                value, i = self._dollar(text, i)
                if value is not None:
                    out.append(self._insert(value, quote))
                    continue
            out.append(c)
            i += 1
        return "".join(out)

    def _dollar(self, text: str, i: int) -> tuple[str | None, int]:
        """The value of the `$` form at text[i] and the index after it; (None, i) for a literal `$`."""
        nxt = text[i + 1]
        if text.startswith("$((", i):
            end = _closing(text, i + 3, "(", ")")
            if end < 0 or text[end:end + 1] != ")":
                raise ScriptError(f"line {self.line}: unclosed $(( ... ))")
            known = len(self.unresolved)
            inner = self.expand_plain(text[i + 3:end - 1])
            inner = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.lookup(m.group()) or "0", inner)
            return self._arithmetic_of(inner, known), end + 1
        if nxt == "(":
            end = _closing(text, i + 2, "(", ")")
            if end < 0:
                raise ScriptError(f"line {self.line}: unclosed $( ... )")
            known = len(self.unresolved)
            words = shlex.split(self.expand(text[i + 2:end - 1]))
            if words[:1] == ["expr"]:
                return self._arithmetic_of(" ".join(words[1:]), known), end
            self.problems.append(f"line {self.line}: the command substitution {text[i:end]!r} is not run here; "
                                 f"replace it with its value")
            return "", end
        if nxt == "{":
            end = text.find("}", i + 2)
            if end < 0:
                raise ScriptError(f"line {self.line}: unclosed ${{ (the command looks cut off)")
            body = text[i + 2:end]
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?", body, re.DOTALL)
            if not m:
                raise ScriptError(f"line {self.line}: ${{{body}}} is not read here (only ${{NAME}} and "
                                  f"${{NAME:-default}})")
            name, op, default = m.groups()
            if op == ":-" and self.values.get(name) == "":
                return self.expand_plain(default), end + 1
            return self.lookup(name, None if op is None else self.expand_plain(default)), end + 1
        m = NAME.match(text, i + 1) or re.compile(r"[0-9@*#?$!]").match(text, i + 1)
        if not m:
            return None, i
        return self.lookup(m.group()), m.end()

    def _arithmetic_of(self, expr: str, known: int) -> str:
        """_arithmetic, naming the variables without a value when they are why it fails: `16 /` alone would not
        tell the user that `$nproc_per_node` was never set."""
        try:
            return _arithmetic(expr, self.line)
        except ScriptError:
            unset = self.unresolved[known:]
            if not unset:
                raise
            names = ", ".join(f"${n}" for n in unset)
            raise ScriptError(f"line {self.line}: the arithmetic uses {names}, which has no value in the script "
                              f"(so it reads {expr.strip()!r}); set it before the command") from None

    def expand_plain(self, text: str) -> str:
        """Expansion inside `${NAME:-...}` and `$(...)`: the value as a plain string."""
        return " ".join(shlex.split(self.expand(text))) if text.strip() else ""

    @staticmethod
    def _insert(value: str, quote: str) -> str:
        if quote == '"':
            return value.replace("\\", "\\\\").replace('"', '\\"')
        if quote == "'":
            return value
        # unquoted: the shell splits the value into words and removes no quotes in it
        return " ".join(shlex.quote(w) for w in value.split())


def _assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The leading `NAME=value` words as a dict, and the words after them."""
    out: dict[str, str] = {}
    while words and (m := ASSIGNMENT.fullmatch(words[0])):
        out[m.group(1)] = m.group(2)
        words = words[1:]
    return out, words


def commands(script: str, given: dict[str, str] | None = None) -> list[Command]:
    """The script's simple commands in order, expanded with the variables assigned before each one;
    `given` (--var NAME=VALUE) wins over the script's own assignments."""
    given = dict(given or {})
    values: dict[str, str] = dict(given)
    taint: dict[str, tuple[str, ...]] = {}
    exported: dict[str, str] = {}
    out: list[Command] = []
    for raw in logical_commands(script):
        ex = _Expander(values, taint, raw.line)
        if raw.cut:
            ex.problems.append(raw.cut)
        try:
            words = shlex.split(ex.expand(raw.text))
        except ScriptError:
            raise
        except ValueError as e:
            raise ScriptError(f"line {raw.line}: {e}") from None
        while words and words[0] in _WRAPPERS:
            words = words[1:]
        exporting = words[:1] == ["export"] or words[:2] == ["declare", "-x"]
        if exporting:
            words = words[2:] if words[0] == "declare" else words[1:]
        prefix, words = _assignments(words)
        if not exporting and prefix and words[:1] == ["export"]:
            # `A=1 export B=2`: bash exports B and forgets A, which lived only for the `export` builtin
            exporting = True
            prefix, words = _assignments(words[1:])
        if exporting or not words:  # assignments (and `export NAME` of an earlier one)
            for name, value in prefix.items():
                if name not in given:
                    values[name] = value
                    taint[name] = tuple(ex.unresolved)
                if name in exported:  # an exported variable assigned again stays exported
                    exported[name] = values[name]
                if exporting:
                    exported[name] = values[name]
            if exporting:
                for name in words:
                    if NAME.fullmatch(name) and name in values:
                        exported[name] = values[name]
            continue
        # an exported variable whose value needed an unset one leaves this command's environment unresolved too
        unresolved = list(ex.unresolved) + [n for v in exported for n in taint.get(v, ()) if n not in ex.unresolved]
        out.append(Command(tuple(words), raw.line, {**exported, **prefix}, prefix, tuple(dict.fromkeys(unresolved)),
                           tuple(ex.problems)))
    return out
