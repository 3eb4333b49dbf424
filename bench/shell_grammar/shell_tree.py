"""An experimental front end for orchestrator.config.shell_script, kept outside the package: a script split into
its simple commands by tree-sitter's bash grammar (`tree-sitter` + `tree-sitter-bash`) instead of the hand-written
lexer `logical_commands`. It yields the same raw commands (`_Raw`: the text with quotes kept, continuations
joined, comments and here-document bodies dropped; its first and last line; the separator after it), so that
expansion (shell_expand) and the refusal rules (shell_script.commands, command_form) stay ours. A syntax error of
the grammar (an ERROR or MISSING node) raises ScriptError naming its line and column.

Not the reader `orchestrator import` uses: docs/shell-grammar.md has the measurement (compare.py here) and why.
"""
from __future__ import annotations

from typing import Any

from orchestrator.config.shell_expand import ScriptError
from orchestrator.config.shell_script import _Raw

__all__ = ["tree_commands"]

# nodes that are one simple command (or an assignment, read by shell_script as a command of assignments)
_SIMPLE = {"command", "variable_assignment", "variable_assignments", "declaration_command", "unset_command",
           "test_command"}
# nodes whose statements are commands in their own right (a block, a loop's body, a branch)
_BLOCKS = {"program", "compound_statement", "subshell", "if_statement", "elif_clause", "else_clause",
           "while_statement", "for_statement", "c_style_for_statement", "do_group", "case_statement", "case_item",
           "function_definition", "negated_command"}
_SEPARATORS = {";", "&", ";;", ";&", ";;&"}
# parts of a command's span that are not its words
_SKIP = {"comment", "heredoc_body", "heredoc_end"}
_MISSING = {'"': 'a " quote', "'": "a ' quote", "`": "a ` command substitution", ")": "a `(` or `$(`",
            "))": "a `$((`", "}": "a `{` or `${`", "]": "a `[`", "]]": "a `[[`", "fi": "an `if`", "done": "a loop",
            "esac": "a `case`"}
_PARSER: Any = None


def _parser() -> Any:
    """The bash parser, made once (ScriptError where the packages are not installed)."""
    global _PARSER
    if _PARSER is None:
        try:
            import tree_sitter
            import tree_sitter_bash
        except ImportError as e:  # an optional reader: say what to install rather than a traceback
            raise ScriptError(f"line 1: the tree-sitter reader needs `pip install tree-sitter tree-sitter-bash` "
                              f"({e})") from None
        _PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bash.language()))
    return _PARSER


def tree_commands(script: str) -> list[_Raw]:
    """Split `script` into its simple commands' raw text in order, as the grammar reads them; ScriptError at the
    first syntax error, naming its line and column."""
    cut = ""
    body = script
    if _ends_escaped(body):  # the text stops right after a `\`: a paste cut off (as logical_commands reads it)
        body = body[:-1]
        cut = f"line {body.count(chr(10)) + 1}: the script ends with a line continuation `\\`: the command looks cut off"
    elif "\n" in body and not body[body.rindex("\n"):].strip() and _ends_escaped(body[:body.rindex("\n")]):
        # a last line ending in `\`, then only the final newline (and blanks): bash ends the command there, where the
        # grammar reports an error
        body = body[:body.rindex("\n") - 1] + "\n"
    data = body.encode("utf-8", "surrogatepass")
    root = _parser().parse(data).root_node
    if root.has_error:
        _raise_first_error(root, data)
    out: list[_Raw] = []
    _block(root, data, out, "")
    if cut and out:
        out[-1] = _Raw(out[-1].text, out[-1].line, cut, out[-1].end, out[-1].last)
    return out


def _ends_escaped(text: str) -> bool:
    """Whether `text` ends in a `\\` that escapes nothing (an odd run of them)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


def _block(node: Any, data: bytes, out: list[_Raw], end: str) -> None:
    """The statements of a block, each ended by the `;` / `&` after it (the last by `end`)."""
    children = node.children
    for i, child in enumerate(children):
        if not child.is_named:
            continue
        after = children[i + 1].type if i + 1 < len(children) and not children[i + 1].is_named else ""
        _statement(child, data, out, after if after in _SEPARATORS else end if i == len(children) - 1 else "")


def _statement(node: Any, data: bytes, out: list[_Raw], end: str) -> None:
    """One statement's simple commands: a pipeline's and a list's parts, a redirected command, a block's."""
    kind = node.type
    if kind in _SIMPLE:
        out.append(_raw(node, data, end))
    elif kind == "redirected_statement":
        inner = node.child_by_field_name("body")
        if inner is None or inner.type in _SIMPLE:  # the redirections stay in the text: read_launch lists them
            out.append(_raw(node, data, end))
        else:
            _statement(inner, data, out, end)
    elif kind == "pipeline":
        parts = node.children
        for i, part in enumerate(parts):
            if part.is_named:
                pipe = parts[i + 1].type if i + 1 < len(parts) else end
                _statement(part, data, out, pipe)
    elif kind == "list":
        parts = [c for c in node.children]
        for i, part in enumerate(parts):
            if part.is_named:
                _statement(part, data, out, parts[i + 1].type if i + 1 < len(parts) else end)
    elif kind in _BLOCKS:
        _block(node, data, out, end)


def _raw(node: Any, data: bytes, end: str) -> _Raw:
    """A simple command's text from its span: comments and here-document bodies left out, `\\`-newline joined."""
    pieces: list[bytes] = []
    at = node.start_byte
    for start, stop in _skipped(node):
        pieces.append(data[at:start])
        at = max(at, stop)
    pieces.append(data[at:node.end_byte])
    text = _joined(b"".join(pieces).decode("utf-8", "surrogatepass"))
    return _Raw(text.strip(), node.start_point[0] + 1, "", end, node.end_point[0] + 1)


def _skipped(node: Any) -> list[tuple[int, int]]:
    """The byte ranges under `node` that are not its words (comments, here-document bodies), in order."""
    found: list[tuple[int, int]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n.type in _SKIP:
            found.append((n.start_byte, n.end_byte))
            continue
        stack.extend(n.children)
    return sorted(found)


def _joined(text: str) -> str:
    """`text` with its `\\`-newline continuations removed (inside single quotes they are literal)."""
    out: list[str] = []
    quote, i = "", 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quote != "'":
            if text[i + 1:i + 2] == "\n":
                i += 2
                continue
            out.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"" and quote in ("", c):
            quote = "" if quote else c
        out.append(c)
        i += 1
    return "".join(out)


def _raise_first_error(root: Any, data: bytes) -> None:
    """ScriptError for the first ERROR or MISSING node: its line and column, what is wrong, the next step."""
    stack = [root]
    while stack:
        n = stack.pop()
        if n.is_missing or n.type == "ERROR":
            break
        stack.extend(reversed([c for c in n.children if c.has_error or c.is_missing]))
    else:
        return
    line, col = n.start_point[0] + 1, n.start_point[1] + 1
    if n.is_missing:
        opener = n.parent
        where = f"line {opener.start_point[0] + 1}" if opener is not None else f"line {line}"
        what = _MISSING.get(n.type, f"a construct that needs `{n.type}`")
        raise ScriptError(f"{where}: unclosed: {what} opened here (column "
                          f"{opener.start_point[1] + 1 if opener is not None else col}) is never closed before line "
                          f"{line}, column {col} (the command looks cut off); close it, or paste the whole command")
    text = data[n.start_byte:n.end_byte].decode("utf-8", "replace").strip().split("\n")[0][:40]
    if text[:1] in ("'", '"', "`"):  # a quote that runs to the end of the script
        raise ScriptError(f"line {line}: unclosed {text[0]} quote at column {col} (the command looks cut off); close "
                          "it, or paste the whole command")
    raise ScriptError(f"line {line}: bash cannot read the script at column {col}"
                      + (f" (`{text}`)" if text else " (it ends too early)")
                      + ": a quote, bracket or `\\` line end is missing or extra there; fix that line, or give "
                      "import only the training command")
