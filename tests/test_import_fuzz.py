"""`orchestrator import` never raises, whatever the text: the real commands (tests/fixtures/commands, ms-swift's
examples old and new, the field command) mutated as pastes and edits break them (lines dropped or duplicated, a cut
anywhere, quotes, backslashes, `#`, unicode, env prefixes, emptied values, wrappers and redirections inserted) each
end in exit 0, or exit 2 with exactly one `orchestrator: error:` line that names the place (a line, or the whole
script). Run in-process (click's CliRunner) so that hundreds fit in seconds; ORCHESTRATOR_IMPORT_FUZZ=N runs N."""
from __future__ import annotations

import os
import re

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recipes import ROOT

from orchestrator.ops.cli import main

FIXTURES = ROOT / "tests" / "fixtures"
SOURCES = sorted([*(FIXTURES / "commands").glob("*.sh"), *(FIXTURES / "ms-swift-old").rglob("*.sh"),
                  *(FIXTURES / "ms-swift" / "examples").rglob("*.sh"), FIXTURES / "field" / "397b-command.sh"])
TEXTS = [p.read_text(encoding="utf-8") for p in SOURCES]
EXAMPLES = int(os.environ.get("ORCHESTRATOR_IMPORT_FUZZ", "800"))

# what a paste or an edit puts into a script
_PIECES = ["'", '"', "\\", "\\\n", " \\ ", "#", " # note", "\n", "\t", "é", "中文", "\u00a0", "\u200b", "“", "”",
           "—", "–", "$", "${", "}", "$(", ")", "$((", "`", ";", "&", "|", "&&", "(", "{", "=", "--", " -- ",
           "A=1 ", "X= ", "NPROC_PER_NODE=1 ", "NNODES=1 ", "CUDA_VISIBLE_DEVICES=0 \\\n", "export NPROC_PER_NODE=1\n",
           "nohup ", "setsid ", "nice -n 10 ", "time ", "env A=1 ", "exec ", "srun ", "mpirun -np 2 ",
           " > train.log 2>&1 &", " | tee log", " 2>&1 | tee -a log", "<<EOF\n", "ARR=(a b)\n", "${ARR[@]}",
           "${#ARR[@]}", "$(nproc)", "source env.sh\n", "\x00", "\r\n", "```", "$ ", "0", "1.5e-4", "None"]
_ERROR = "orchestrator: error:"
# refusals about the script as a whole, which have no one line to name
_WHOLE = re.compile(r"no `megatron sft` or `swift sft` command found|sft commands \(lines|the imported recipe is "
                    r"not valid|PowerShell|cannot read it")


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A real script with 1 to 4 mutations applied."""
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        kind = draw(st.sampled_from(["drop", "duplicate", "cut", "insert", "insert", "insert", "empty", "prefix"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if kind == "drop" and len(lines) > 1:
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "prefix":
            lines[i] = draw(st.sampled_from(_PIECES[38:47] + ["A=1 B= ", "env ", "nohup \\\n"])) + lines[i]
        elif kind == "empty":  # a flag's or a variable's value emptied
            lines[i] = re.sub(r"(=|--[\w-]+ )\S+", r"\1", lines[i], count=1)
        text = "\n".join(lines)
        if kind == "cut":
            text = text[:draw(st.integers(0, len(text)))]
        elif kind == "insert":
            at = draw(st.integers(0, len(text)))
            piece = draw(st.sampled_from(_PIECES) | st.text(max_size=3))
            text = text[:at] + piece + text[at:]
    return text


def check(text: str) -> None:
    """Asserts that importing `text` exits 0, or 2 with one error line naming the place, and raises nothing."""
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text)
    assert r.exception is None or isinstance(r.exception, SystemExit), (text, repr(r.exception))
    assert r.exit_code in (0, 2), (text, r.exit_code, r.output)
    errors = [line for line in r.stderr.splitlines() if line.startswith(_ERROR)]
    if r.exit_code == 0:
        assert errors == [], text
        return
    assert len(errors) == 1 and len(r.stderr.strip().splitlines()) == 1, (text, r.stderr)
    message = errors[0].removeprefix(f"{_ERROR} -: ")
    assert re.search(r"\bline \d+", message) or _WHOLE.search(message), (text, message)
    assert "please report it" not in message, (text, message)  # the self-check: a bug of the importer


def test_the_sources_are_the_real_sets():
    assert len(SOURCES) >= 130 and all(TEXTS)


def test_mutated_real_commands_never_raise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe is validated from a scratch file beside where it would go
    seen: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated())
    def run(text: str) -> None:
        seen.append(1)
        check(text)

    run()
    print(f"{len(seen)} mutated inputs imported")
    assert len(seen) >= EXAMPLES * 0.9


@pytest.mark.parametrize("text", TEXTS[::7])
def test_the_real_commands_themselves_never_raise(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check(text)
