"""Side by side: `orchestrator import` with its hand-written shell reader and with the tree-sitter one
(shell_tree.py here, swapped in for shell_script.logical_commands), on the real sets and the fuzz test's mutated
inputs. Needs the two packages, which are not dependencies of the orchestrator (docs/shell-grammar.md):

    pip install --target /tmp/ts-pkgs tree-sitter tree-sitter-bash
    PYTHONPATH=$PWD:/tmp/ts-pkgs python bench/shell_grammar/compare.py [FUZZ_INPUTS]

Prints, per reader, the scores of tests/fixtures/{commands,ms-swift-old}/measure.py (right / total, tune and
held-out), their --counts and ms-swift's examples' counts (imported / refused / crashed, flags accounted), the fuzz
outcomes (ok / refused / failing the fuzz test's check) and the tune-split files on which the two differ (held-out
ones are counted, never shown).
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "support"), str(Path(__file__).parent)]

import shell_tree
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings

from orchestrator.config import shell_script
from orchestrator.ops.cli import main

READERS = {"hand": shell_script.logical_commands, "tree": shell_tree.tree_commands}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use(reader: str) -> None:
    """Makes `reader` the one shell_script.commands splits scripts with."""
    shell_script.logical_commands = READERS[reader]


def outcome(text: str) -> tuple[str, str]:
    """How `orchestrator import -` ends on `text`: ok, refused (one error line) or crash, and the message."""
    r = CliRunner().invoke(main, ["import", "-", "--json"], input=text)
    errors = [line for line in r.stderr.splitlines() if line.startswith("orchestrator: error:")]
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return "crash", f"{type(r.exception).__name__}: {r.exception}"[:200]
    if r.exit_code == 0:
        return "ok", ""
    if r.exit_code == 2 and len(errors) == 1 and len(r.stderr.strip().splitlines()) == 1:
        return "refused", errors[0]
    return "crash", f"exit {r.exit_code}: {r.stderr[-200:]}"


def real_sets() -> None:
    """The measure.py scores and counts per reader, then the files whose outcome differs."""
    cm = _load("commands_measure", ROOT / "tests/fixtures/commands/measure.py")
    om = _load("old_measure", ROOT / "tests/fixtures/ms-swift-old/measure.py")
    new = sorted((ROOT / "tests/fixtures/ms-swift/examples").rglob("*.sh"))
    for reader in READERS:
        use(reader)
        old = om.figures([(e, om.score(e)) for e in om.entries()])
        print(reader, json.dumps({
            "commands": cm.summary([cm.score(e) for e in cm.entries()]),
            "commands --counts": cm.outcome_counts([cm.HERE / e["file"] for e in cm.entries()]),
            "ms-swift-old": {s: {"right": f["right"], "total": f["total"]} for s, f in old.items()},
            "ms-swift-old --counts": cm.outcome_counts([om.HERE / e["file"] for e in om.entries()]),
            "ms-swift examples --counts": cm.outcome_counts(new)}))
    files = [(cm.HERE / e["file"], e["split"]) for e in cm.entries()]
    files += [(om.HERE / e["file"], e["split"]) for e in om.entries()] + [(p, "tune") for p in new]
    held = 0
    for path, split in files:
        text = path.read_text(encoding="utf-8")
        got = {}
        for reader in READERS:
            use(reader)
            got[reader] = outcome(text)
        if got["hand"] != got["tree"]:
            if split == "heldout":
                held += 1
                continue
            print(f"DIFF {path.relative_to(ROOT)}\n  hand: {got['hand']}\n  tree: {got['tree']}")
    print(f"{len(files)} files; held-out files whose outcome differs: {held}")


def fuzz(n: int) -> None:
    """The fuzz test's first `n` mutated inputs through both readers: outcomes, pairs, and the differences."""
    import test_import_fuzz as fz
    texts: list[str] = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fz.mutated())
    def draw(text: str) -> None:
        texts.append(text)

    draw()
    stats = {r: collections.Counter() for r in READERS}
    pairs: collections.Counter = collections.Counter()
    for text in texts:
        got = {}
        for reader in READERS:
            use(reader)
            try:
                fz.check(text)
                got[reader] = outcome(text)
            except AssertionError:
                got[reader] = ("fails the check", "")
            stats[reader][got[reader][0]] += 1
        pairs[(got["hand"][0], got["tree"][0])] += 1
        if got["hand"][0] != got["tree"][0]:
            print(f"FUZZ DIFF hand {got['hand'][0]}, tree {got['tree'][1] or got['tree'][0]}")
    print(f"{len(texts)} mutated inputs:", {r: dict(s) for r, s in stats.items()},
          {f"{h} / {t}": c for (h, t), c in pairs.items()})


if __name__ == "__main__":
    os.chdir(tempfile.mkdtemp(prefix="shell-grammar-"))  # import validates recipes beside where they would go
    real_sets()
    fuzz(int(sys.argv[1]) if len(sys.argv) > 1 else 800)
