"""Expansion of one raw shell command's `$` forms, given the variables set before it: `$VAR`, `${VAR}`,
`${VAR:-default}`, arrays (`"${ARR[@]}"`, `${ARR[0]}`, `${#ARR[@]}`), `$((...))` and `$(expr ...)` integer
arithmetic. A command substitution (`$(nproc)`, backticks) is not run: it stays in the text as written and is
recorded (`substitutions`), for the caller to decide whether the command needs it (a log file's name does not);
a variable with no value is recorded as unresolved. Pure and stdlib-only; shell_script splits the script into
commands and calls it.
"""
from __future__ import annotations

import re
import shlex

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_ARRAY = re.compile(r"(#?)([A-Za-z_][A-Za-z0-9_]*)\[([@*]|\d+)\]")


class _Substitution(str):
    """A command substitution as written, which expansion keeps in the text."""


class ScriptError(ValueError):
    """The script cannot be read as shell commands; the message names the line."""


_ARITH = re.compile(r"^[0-9+\-*/%() \t]*$")


def _arithmetic(expr: str, line: int) -> str:
    """Integer arithmetic of `$((...))` / `expr`: + - * / % and parentheses, / truncating as the shell does."""
    if not _ARITH.match(expr) or not expr.strip() or "**" in expr:  # no powers: 9**9**9 never ends
        raise ScriptError(f"line {line}: cannot evaluate the arithmetic {expr.strip()!r}: import reads whole "
                          "numbers with + - * / % and parentheses; write the value itself")
    py = re.sub(r"(?<![/])/(?![/])", "//", expr)
    try:
        value = eval(py, {"__builtins__": {}}, {})
    except ZeroDivisionError:
        raise ScriptError(f"line {line}: the arithmetic {expr.strip()!r} divides by zero; write the value "
                          "itself") from None
    except (SyntaxError, TypeError, ValueError, MemoryError, OverflowError):
        raise ScriptError(f"line {line}: the arithmetic {expr.strip()!r} is incomplete (a number missing between "
                          "its operators: a variable empty, or the line cut); write the value itself") from None
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


class Expander:
    """`$...` in one raw command, given the variables so far: the text with values inserted (quoted so that
    shlex splits it as the shell would) and the names that had no value."""

    def __init__(self, values: dict[str, str], taint: dict[str, tuple[str, ...]], line: int,
                 arrays: dict[str, list[str]] | None = None):
        self.values, self.taint, self.line, self.arrays = values, taint, line, arrays or {}
        self.unresolved: list[str] = []
        self.problems: list[str] = []
        self.substitutions: list[str] = []  # command substitutions left as written (not run)
        self.empty: list[str] = []  # variables whose value is empty (why an arithmetic can fail)

    def lookup(self, name: str, default: str | None = None) -> str:
        if name in self.values:
            self.unresolved += [n for n in self.taint.get(name, ()) if n not in self.unresolved]
            if self.values[name] == "" and name not in self.empty:
                self.empty.append(name)
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
                if end < 0:
                    raise ScriptError(f"line {self.line}: a ` opens a command substitution that is never closed (the "
                                      "command looks cut off)")
                out.append(self._literal(text[i:end + 1], quote))
                i = end + 1
                continue
            elif c == "$" and quote != "'" and i + 1 < len(text):
                value, i = self._dollar(text, i)
                if isinstance(value, _Substitution):
                    out.append(self._literal(value, quote))
                    continue
                if isinstance(value, list):  # an array's elements: one word each, quoted or not
                    out.append('" "'.join(self._insert(v, quote) for v in value) if quote else
                               " ".join(shlex.quote(v) for v in value))
                    continue
                if value is not None:
                    out.append(self._insert(value, quote))
                    continue
            out.append(c)
            i += 1
        return "".join(out)

    def _literal(self, substitution: str, quote: str) -> str:
        """Keeps a command substitution in the text as written (one word when unquoted), and records it."""
        self.substitutions.append(substitution)
        return self._insert(substitution, quote) if quote else shlex.quote(substitution)

    def _dollar(self, text: str, i: int) -> tuple[str | list[str] | None, int]:
        """The value of the `$` form at text[i] and the index after it; (None, i) for a literal `$`."""
        nxt = text[i + 1]
        if text.startswith("$((", i):
            end = _closing(text, i + 3, "(", ")")
            if end < 0 or text[end:end + 1] != ")":
                raise ScriptError(f"line {self.line}: unclosed $(( ... ))")
            known = self._known()
            inner = self.expand_plain(text[i + 3:end - 1])
            inner = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.lookup(m.group()) or "0", inner)
            return self._arithmetic_of(inner, known), end + 1
        if nxt == "(":
            end = _closing(text, i + 2, "(", ")")
            if end < 0:
                raise ScriptError(f"line {self.line}: unclosed $( ... )")
            known = self._known()
            words = shlex.split(self.expand(text[i + 2:end - 1]))
            if words[:1] == ["expr"]:
                return self._arithmetic_of(" ".join(words[1:]), known), end
            del self.substitutions[known[2]:]  # the outer one is what is not run
            return _Substitution(text[i:end]), end
        if nxt == "{":
            end = text.find("}", i + 2)
            if end < 0:
                raise ScriptError(f"line {self.line}: unclosed ${{ (the command looks cut off)")
            body = text[i + 2:end]
            if (a := _ARRAY.fullmatch(body)) is not None:
                return self._array(*a.groups()), end + 1
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?", body, re.DOTALL)
            if not m:
                raise ScriptError(f"line {self.line}: `${{{body}}}` is a form of `${{...}}` import does not read (it "
                                  "reads ${NAME}, ${NAME:-default}, ${ARR[@]}, ${ARR[N]}, ${#ARR[@]}); replace it "
                                  "with its value")
            name, op, default = m.groups()
            if op == ":-" and self.values.get(name) == "":
                return self.expand_plain(default), end + 1
            return self.lookup(name, None if op is None else self.expand_plain(default)), end + 1
        m = NAME.match(text, i + 1) or re.compile(r"[0-9@*#?$!]").match(text, i + 1)
        if not m:
            return None, i
        return self.lookup(m.group()), m.end()

    def _array(self, count: str, name: str, index: str) -> str | list[str]:
        """`${ARR[@]}` (the elements), `${ARR[N]}` (one), `${#ARR[@]}` (how many); a plain variable is an array of
        one, as in bash."""
        if name not in self.arrays and name not in self.values:
            self.lookup(name)
            return "0" if count else []
        elements = self.arrays.get(name, [self.values.get(name, "")])
        if count:
            return str(len(elements)) if index in "@*" else str(len(elements[int(index)] if int(index) < len(elements)
                                                                      else ""))
        if index in "@*":
            return elements
        return elements[int(index)] if int(index) < len(elements) else ""

    def _known(self) -> tuple[int, int, int]:
        """How many unresolved, empty and substituted there are so far (to tell which came from an arithmetic)."""
        return len(self.unresolved), len(self.empty), len(self.substitutions)

    def _arithmetic_of(self, expr: str, known: tuple[int, int, int]) -> str:
        """_arithmetic, naming what is why it fails: `16 /` alone would not tell the user that `$nproc_per_node`
        was never set, or is empty, or comes from a `$(nproc)` that import does not run."""
        try:
            return _arithmetic(expr, self.line)
        except ScriptError:
            unset, empty = self.unresolved[known[0]:], self.empty[known[1]:]
            subs = self.substitutions[known[2]:] + re.findall(r"\$\(.*\)|`[^`]*`", expr)
            del self.substitutions[known[2]:]
            names = ", ".join(f"${n}" for n in unset)
            if subs:
                raise ScriptError(f"line {self.line}: the arithmetic {expr.strip()!r} uses "
                                  f"{', '.join(f'`{s}`' for s in dict.fromkeys(subs))}, which import does not run; "
                                  + (f"give {names} with --var NAME=VALUE" if unset else "replace it with its value")
                                  ) from None
            if unset:
                raise ScriptError(f"line {self.line}: the arithmetic uses {names}, which has no value in the script "
                                  f"(so it reads {expr.strip()!r}); set it before the command, or give it with --var "
                                  "NAME=VALUE") from None
            if empty:
                raise ScriptError(f"line {self.line}: the arithmetic uses {', '.join(f'${n}' for n in empty)}, which "
                                  f"is empty (so it reads {expr.strip()!r}); set it to a number before the command, "
                                  "or give it with --var NAME=VALUE") from None
            raise

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
