"""`orchestrator import SCRIPT`: a shell script (or a pasted command) that runs `megatron sft` / `swift sft` as
a recipe, and a report of what happened to every flag. The recipe is validated like any other (and its
rendered command checked to carry every flag not dropped) before it is written; nothing is run."""
from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from orchestrator.config import recipe as R
from orchestrator.config.command_form import ImportRefused, Training, find_training
from orchestrator.config.import_check import round_trip_problems
from orchestrator.config.importer import Imported, translate
from orchestrator.config.legacy import modernise
from orchestrator.config.paste import unwrap
from orchestrator.config.render.command import render_command, rendering_problems
from orchestrator.config.shell_script import ScriptError, commands
from orchestrator.ops.demo import to_toml

_SECTIONS = list(R.Recipe.model_fields)


@dataclass
class Result:
    """A recipe imported: its TOML text, the report (as `--json` prints it) and where it was written."""

    toml: str
    report: dict
    output: Path | None


def run_name(output: Path | None, script: str, data: dict) -> str:
    """The recipe's run.name: the output file's stem, else the script's, else output_dir's last part."""
    for candidate in (output.stem if output else "", Path(script).stem if script != "-" else "",
                      Path(str(data.get("run", {}).get("output_dir", ""))).name, "imported"):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", candidate).strip("-.")
        if name:
            return name
    return "imported"


def _ordered(data: dict) -> dict:
    return {k: data[k] for k in sorted(data, key=lambda k: _SECTIONS.index(k) if k in _SECTIONS else 99)}


def recipe_text(data: dict, source: str, t: Training, imported: Imported) -> str:
    """The recipe as TOML, headed by where it came from and what the import dropped."""
    head = [f"# Imported by `orchestrator import` from {source} (the command at line {t.line}, `{t.form}`).",
            "# Relative paths are relative to this file. Check it with `orchestrator plan <this file>`."]
    if imported.dropped:
        head.append("# Not carried over (see `orchestrator import --json` for the whole report):")
        head += [f"#   {d['flag']} {d['value']}".rstrip() + f": {d['reason']}" for d in imported.dropped]
    head += [f"# Note: {n}" for n in imported.notes]
    # one line each: a TOML comment holds no line break or control character, whatever the paste had in a value
    return "\n".join(one_line(h) for h in head) + "\n\n" + to_toml(_ordered(data))


def _from_flags(problems: tuple[R.Problem, ...], imported: Imported) -> list[str]:
    """Recipe problems, each naming the flags its key came from."""
    entries = imported.mapped + imported.renamed
    out = []
    for p in problems:
        keys = {p.key} if p.key else set()
        came = [f"{e['flag']} {e['value']}".rstrip() for e in entries if e["key"] in keys]
        out.append(f"{p.key}: {p.message}" + (f" (from {', '.join(came)})" if came else "") if p.key else p.message)
    return out


def import_script(text: str, source: str, output: Path | None, variables: dict[str, str]) -> Result:
    """SCRIPT's text -> Result; ImportRefused (exit 2) for anything that keeps it from a valid recipe."""
    try:
        cmds = commands(unwrap(text), variables)
    except ScriptError as e:
        raise ImportRefused([str(e)]) from None
    found, _ = find_training(cmds)
    legacy = modernise(found)  # 2.x / 3.x values in their 4.x form, before the flags are renamed and mapped
    t = legacy.training
    imported = translate(t, "imported")
    imported.dropped[:0] = legacy.dropped
    imported.notes[:0] = legacy.notes
    imported.recipe["run"]["name"] = run_name(output, source, imported.recipe)
    toml = recipe_text(imported.recipe, source, t, imported)
    where = (output.parent if output else Path.cwd()).absolute()
    recipe, where = _validated(toml, where, imported)
    cmd = render_command(recipe, None, 29500, 10)
    lost = round_trip_problems(t, imported, cmd.argv, cmd.env, where)
    if lost:  # a bug in the importer, not the user's input: refused rather than a recipe that silently differs
        raise ImportRefused([f"line {t.line}: the recipe would not carry {'; '.join(lost)}, and import has no reason "
                             "to drop it: nothing written (a bug in `orchestrator import`: please report it with the "
                             "script); write the recipe by hand (`orchestrator demo` shows one)"])
    report = {"recipe": imported.recipe, "output": str(output) if output else None, "mapped": imported.mapped,
              "renamed": imported.renamed, "dropped": imported.dropped, "unresolved": [], "notes": imported.notes,
              "ignored": list(t.others)}
    return Result(toml, report, output)


def _validated(toml: str, where: Path, imported: Imported) -> tuple[R.Recipe, Path]:
    """The recipe loaded from a scratch file beside where it goes (its relative paths resolve as they will
    there; in a temporary directory where that one cannot be written) and the directory it resolved against."""
    scratch = None
    try:
        fd, name = tempfile.mkstemp(dir=where, prefix=".orchestrator-import-", suffix=".toml")
    except OSError:
        scratch = where = Path(tempfile.mkdtemp(prefix="orchestrator-import-"))
        fd, name = tempfile.mkstemp(dir=where, suffix=".toml")
    path = Path(name)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(toml)
        return R.load(path, checks=[rendering_problems]), where
    except R.RecipeError as e:
        raise ImportRefused(["the imported recipe is not valid: " + m for m in
                             _from_flags(e.problems, imported)] or [str(e)]) from None
    finally:
        path.unlink(missing_ok=True)
        if scratch is not None:
            scratch.rmdir()


def write(result: Result, force: bool) -> None:
    """Write the recipe to result.output (by rename: never half a file); an existing file only with force."""
    out = result.output
    assert out is not None
    if out.exists() and not force:
        raise ImportRefused([f"{out} exists: choose another --output, or add --force to replace it"])
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(result.toml, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        raise ImportRefused([f"{out}: cannot write ({e.strerror or e})"]) from None


def report_text(result: Result) -> str:
    """The report for people: what each flag became."""
    r = result.report
    lines = [(f"imported {len(r['mapped']) + len(r['renamed'])} flags and variables"
             f"{' into ' + r['output'] if r['output'] else ''}; {len(r['dropped'])} not carried over")]
    for e in r["mapped"]:
        lines.append(f"  {e['flag']} {e['value']}".rstrip() + f"  ->  {e['key']}")
    for e in r["renamed"]:
        lines.append(f"  {e['flag']} {e['value']}".rstrip() + f"  ->  {e['to']} (4.x name)  ->  {e['key']}")
    if r["dropped"]:
        lines.append("not carried over:")
        lines += [f"  {e['flag']} {e['value']}".rstrip() + f": {e['reason']}" for e in r["dropped"]]
    lines += [f"note: {n}" for n in r["notes"]]
    lines += [f"ignored (not the training): {o}" for o in r["ignored"]]
    if r["output"]:
        lines.append(f"next: orchestrator plan {r['output']}    then: orchestrator run {r['output']}")
    return "\n".join(lines)


def refusal_json(e: ImportRefused, source: str) -> str:
    """An ImportRefused as `--json` prints it: the error, one problem per line, the unresolved variables."""
    return json.dumps({"error": str(e), "problems": [{"key": None, "message": p, "source": source}
                                                     for p in e.problems],
                       "unresolved": list(e.unresolved)}, indent=2)


def one_line(text: str) -> str:
    """`text` with its line breaks and other unprintable characters escaped (`\\n`, `\\x0c`), so that a message
    quoting a pasted value stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(script: str, output: Path | None, variables: tuple[str, ...], force: bool, as_json: bool) -> int:
    """The `import` command: read SCRIPT (- is stdin), write the recipe (or print it), report; the exit code."""
    def refuse(e: ImportRefused) -> int:
        if as_json:
            click.echo(refusal_json(e, script))
        # one message, however many problems: each is named in it (and listed apart in --json)
        click.echo(one_line(f"orchestrator: error: {script}: {'; '.join(e.problems)}"), err=True)
        return 2

    given: dict[str, str] = {}
    for item in variables:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            return refuse(ImportRefused([f"--var {item!r}: expected NAME=VALUE"]))
        given[name] = value
    try:
        text = sys.stdin.read() if script == "-" else Path(script).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return refuse(ImportRefused([f"cannot read it ({getattr(e, 'strerror', None) or e})"]))
    try:
        result = import_script(text, "<stdin>" if script == "-" else script, output, given)
        if output is not None:
            write(result, force)
    except ImportRefused as e:
        return refuse(e)
    if as_json:
        click.echo(json.dumps(result.report, indent=2))
    else:
        if output is None:
            click.echo(result.toml, nl=False)
        click.echo(report_text(result), err=output is None)
    return 0
