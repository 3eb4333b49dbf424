"""Imports go downwards only: the package's modules form a DAG in layers, checked from the source.

    domain        types
    decisions     pure functions of data: recipe, render, progress, classify, policy, goodput, estimate, simulate, storage
    world         side effects behind small interfaces: host, launcher, gpu, journal, checkpoints, sync, metrics, ...
    loop          supervisor
    operations    commands and presentation: cli, plan's printing, report, html_report, demo, service, tiny

A module imports from its own layer or below, never above (the supervisor never imports presentation
code), and no two modules import each other, directly or through others.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "orchestrator"
LAYERS = {
    "domain": {"types"},
    "decisions": {"recipe", "render", "progress", "classify", "policy", "goodput", "estimate", "simulate", "storage"},
    "world": {"host", "launcher", "gpu", "notify", "journal", "checkpoints", "manifest", "tailhash", "copytree",
              "sync", "sidecar", "run_checkpoints", "rundir", "metrics", "spot", "watch", "plan", "host_probe"},
    "loop": {"supervisor"},
    "operations": {"cli", "report", "html_report", "demo", "service", "tiny", "__main__", "__init__"},
}
ORDER = list(LAYERS)


def module_of(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return rel.parts[0]  # a subpackage (render/) is one module here


def imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        mod = module_of(path)
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator"):
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("orchestrator.")]
            deps.update(n for n in names if n != mod)
    return graph


def layer(mod: str) -> int:
    for i, name in enumerate(ORDER):
        if mod in LAYERS[name]:
            return i
    raise AssertionError(f"orchestrator/{mod}: not in any layer of tests/test_layering.py; add it where it belongs")


def test_every_module_has_a_layer():
    for mod in imports():
        layer(mod)


def test_imports_go_downwards_only():
    bad = [f"{m} ({ORDER[layer(m)]}) imports {d} ({ORDER[layer(d)]})"
           for m, deps in imports().items() for d in deps if layer(d) > layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = imports()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
