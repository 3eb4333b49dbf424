"""Imports go downwards only: the package's modules form a DAG in layers, checked from the source.

    types       the domain vocabulary (orchestrator/types.py), the root
    config/     recipe, flag tables, rendering, memory and storage budgets: pure functions of the recipe
    domain/     decisions: classify, policy, verdict, progress, goodput, retention, intervals, simulation
    host/       the machine: Host protocol and LocalHost, launch (local, Slurm), GPUs, journal, metrics, evidence
    store/      checkpoints and sync: discovery and verification, manifests, copying, publishing, tracking
    loop/       the supervisor's state machine and its parts: run context, ticker, launch, running, recovery,
                export, attempt, pre-flight, save intervals, GPU gate
    ops/        commands and presentation: cli, plan, report, html_report, demo, service, tiny

A module imports from its own layer or below, never above (the supervisor never imports presentation
code), and no two modules import each other, directly or through others.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "orchestrator"
LAYERS = {
    "types": {"types", "orchestrator"},   # the package itself: imports nothing
    "config": {"config"},
    "domain": {"domain"},
    "host": {"host"},
    "store": {"store"},
    "loop": {"loop"},
    "ops": {"ops", "__main__"},
}
ORDER = list(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_nodes(tree: ast.AST):
    """Every node. Function-level imports count (a lazy import is still a dependency), and so do imports under
    `if TYPE_CHECKING:`: a type named from a layer above is a dependency on it all the same."""
    return ast.walk(tree)


def graph() -> dict[str, set[str]]:
    """orchestrator module -> the orchestrator modules it imports (a package import counts as its __init__)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    out = {}
    for mod, path in files.items():
        deps = set()
        for node in import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {n for n in names if n in files}
        out[mod] = deps - {mod}
    return out


def layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else mod
    for i, name in enumerate(ORDER):
        if top in LAYERS[name]:
            return i
    raise AssertionError(f"{mod}: not in any layer of tests/test_layering.py; add it where it belongs")


def test_every_module_has_a_layer():
    for mod in graph():
        layer(mod)


def test_imports_go_downwards_only():
    bad = [f"{m} ({ORDER[layer(m)]}) imports {d} ({ORDER[layer(d)]})"
           for m, deps in graph().items() for d in deps if layer(d) > layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g, state, found = graph(), {}, []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                found.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not found, "import cycles:\n" + "\n".join(found)


def test_recipe_imports_nothing_from_render():
    g = graph()
    assert "orchestrator.config.recipe" in g["orchestrator.config.render.command"], "the test reads the imports it claims to"
    for m in ("orchestrator.config.recipe", "orchestrator.config.flags"):
        assert not {n for n in g[m] if n.startswith("orchestrator.config.render")}, f"{m} imports {g[m]}"


def test_type_checking_imports_count():
    """A TYPE_CHECKING import is read as a dependency (domain/goodput.py once named the journal that way)."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from orchestrator.host.journal import Journal\n")
    names = [n.module for n in import_nodes(tree) if isinstance(n, ast.ImportFrom)]
    assert "orchestrator.host.journal" in names


def test_nothing_of_the_loop_is_left_at_the_package_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "types.py"], top


def test_no_test_module_imports_another():
    """Helpers live in tests/support/ and shared fixtures in conftest.py: a test module imports neither another
    test module nor conftest."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.glob("test_*.py")) + sorted((tests / "support").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name} imports {n}" for n in names if n.startswith("test_") or n == "conftest"]
    assert not bad, "\n".join(bad)
