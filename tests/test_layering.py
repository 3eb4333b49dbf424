"""Imports go downwards only: the package's modules form a DAG in layers, checked from the source.

    types       the domain vocabulary (orchestrator/types.py), the root
    config/     recipe, flag tables, rendering, memory and storage budgets: pure functions of the recipe
    domain/     decisions: classify, policy, verdict, progress, goodput, retention, intervals, simulation
    host/       the machine: Host protocol and LocalHost, launch (local, Slurm), GPUs, journal, metrics, evidence
    store/      checkpoints and sync: discovery and verification, manifests, copying, publishing, tracking
    loop        supervisor.py (+ lifecycle.py, recovery.py, export_phase.py), watch.py, preflight.py
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
    "loop": {"supervisor", "lifecycle", "recovery", "export_phase", "watch", "preflight", "save_interval"},
    "ops": {"ops", "__main__"},
}
ORDER = list(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node except what sits under `if TYPE_CHECKING:` (annotations only, never imported at run time).
    Function-level imports count: a lazy import is still a dependency."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def graph() -> dict[str, set[str]]:
    """orchestrator module -> the orchestrator modules it imports (a package import counts as its __init__)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    out = {}
    for mod, path in files.items():
        deps = set()
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
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
