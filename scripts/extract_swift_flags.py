#!/usr/bin/env python3
"""Extract the ms-swift 4.x `megatron sft` / `swift sft` flag names from an installed ms-swift.

ms-swift parses its command line with ``transformers.HfArgumentParser`` over one argument dataclass per
command, so every dataclass field (own or inherited) is a ``--flag``. The dataclasses are read here
with :mod:`ast` only: importing ``swift.megatron`` needs megatron-core and TransformerEngine, which a
CPU machine does not have.

Entry classes: ``megatron sft`` -> ``swift.megatron.arguments.sft_args.MegatronSftArguments``,
``swift sft`` -> ``swift.arguments.sft_args.SftArguments`` (which inherits transformers'
``Seq2SeqTrainingArguments``; transformers' source is parsed the same way).

Usage: python scripts/extract_swift_flags.py [--python PY] [--output PATH] [--check]
  --python  interpreter whose site-packages hold ms-swift (default: this one)
  --output  where to write the JSON (default: orchestrator/data/swift_flags.json; '-' = stdout)
  --check   compare with the existing file instead of writing it (exit 1 on a difference)
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ENTRY = {
    "megatron": ("swift.megatron.arguments.sft_args", "MegatronSftArguments"),
    "swift": ("swift.arguments.sft_args", "SftArguments"),
}
ROOTS = ("swift", "transformers")
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "orchestrator" / "data" / "swift_flags.json"


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, name|None)


@dataclass(frozen=True)
class ClassRef:
    module: str
    name: str


class SourceIndex:
    """Lazily parsed modules of the packages in ``roots`` (name -> directory)."""

    def __init__(self, roots: dict[str, Path]):
        self.files: dict[str, tuple[Path, bool]] = {}
        for root, directory in roots.items():
            for path in sorted(directory.rglob("*.py")):
                rel = path.relative_to(directory).with_suffix("").parts
                is_pkg = rel[-1] == "__init__"
                parts = (root, *rel[:-1]) if is_pkg else (root, *rel)
                self.files[".".join(parts)] = (path, is_pkg)
        self._modules: dict[str, Module] = {}
        self._by_name: dict[str, list[ClassRef]] | None = None

    def module(self, name: str) -> Module | None:
        if name in self._modules:
            return self._modules[name]
        if name not in self.files:
            return None
        path, is_pkg = self.files[name]
        mod = Module(name, path, is_pkg)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(tree):  # imports under `if TYPE_CHECKING:` / try blocks count too
            if isinstance(node, ast.ImportFrom):
                src = node.module or ""
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([src] if src else []))
                for alias in node.names:
                    mod.imports.setdefault(alias.asname or alias.name, (src, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        mod.imports.setdefault(alias.asname, (alias.name, None))
                    else:
                        top = alias.name.partition(".")[0]
                        mod.imports.setdefault(top, (top, None))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
        self._modules[name] = mod
        return mod

    def by_name(self, name: str) -> list[ClassRef]:
        """Fallback: every class called ``name`` anywhere in the swift package."""
        if self._by_name is None:
            self._by_name = {}
            for mod_name in self.files:
                if mod_name.split(".")[0] == "swift":
                    for cls in self.module(mod_name).classes:
                        self._by_name.setdefault(cls, []).append(ClassRef(mod_name, cls))
        return self._by_name.get(name, [])

    def resolve(self, module: str, name: str, seen: frozenset = frozenset()) -> ClassRef | None:
        """The class that ``name`` denotes inside ``module`` (following from-imports and re-exports)."""
        if (module, name) in seen:
            return None
        seen = seen | {(module, name)}
        mod = self.module(module)
        if mod is None:
            return None
        if name in mod.classes:
            return ClassRef(module, name)
        if name in mod.imports:
            src, orig = mod.imports[name]
            if orig is not None:
                return self.resolve(src, orig, seen)
        if mod.is_package:  # lazy `_import_structure` packages: try submodules defining the name
            for sub in sorted(self.files):
                if sub.rpartition(".")[0] == module:
                    submod = self.module(sub)
                    if name in submod.classes:
                        return ClassRef(sub, name)
        return None

    def resolve_base(self, module: str, node: ast.expr) -> ClassRef | None:
        if isinstance(node, ast.Name):
            found = self.resolve(module, node.id)
            if found is None:
                candidates = self.by_name(node.id)
                if len(candidates) == 1:
                    return candidates[0]
                if len(candidates) > 1:
                    raise SystemExit(f"{module}: ambiguous base {node.id}: {candidates}")
            return found
        if isinstance(node, ast.Attribute):  # e.g. `transformers.TrainingArguments`, `mod.Cls`
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name):
                mod = self.module(module)
                src = mod.imports.get(node.id, (node.id, None)) if mod else (node.id, None)
                prefix = src[0] if src[1] is None else f"{src[0]}.{src[1]}"
                parts.reverse()
                return self.resolve(".".join([prefix, *parts[:-1]]), parts[-1])
        return None  # Generic[...], object, calls: not dataclasses of interest


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        ):
            return True
    return False


def _annotation_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # string annotation
        return node.value.split("[")[0].rpartition(".")[2]
    return ""


def _own_fields(cls: ast.ClassDef) -> set[str]:
    names = set()
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if name.startswith("_") or _annotation_name(stmt.annotation) in ("ClassVar", "InitVar", "KW_ONLY"):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and _annotation_name(value.func) == "field":
            if any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                   for k in value.keywords):
                continue  # HfArgumentParser skips init=False fields
        names.add(name)
    return names


def collect_fields(index: SourceIndex, ref: ClassRef) -> set[str]:
    """Dataclass fields of ``ref``: own annotations if it is a @dataclass, plus those of every base."""
    out: set[str] = set()
    todo, seen = [ref], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        cls = index.module(cur.module).classes[cur.name]
        if _is_dataclass(cls):
            out |= _own_fields(cls)
        for base in cls.bases:
            resolved = index.resolve_base(cur.module, base)
            if resolved is not None:
                todo.append(resolved)
            elif not (isinstance(base, ast.Name) and base.id in ("object", "ABC")):
                print(f"note: {cur.module}.{cur.name}: base {ast.unparse(base)} not resolved", file=sys.stderr)
    return out


def _locate(python: str | None) -> tuple[dict[str, Path], dict[str, str]]:
    """Package directories and distribution versions, found without importing the packages."""
    if python is None:
        from importlib.metadata import version

        dirs = {}
        for root in ROOTS:
            spec = importlib.util.find_spec(root)
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit(f"{root} is not installed for {sys.executable}")
            dirs[root] = Path(list(spec.submodule_search_locations)[0])
        return dirs, {"ms_swift": version("ms-swift"), "transformers": version("transformers")}
    code = (
        "import importlib.util as u, importlib.metadata as m, json\n"
        "print(json.dumps({'dirs': {r: list(u.find_spec(r).submodule_search_locations)[0] for r in %r},"
        " 'versions': {'ms_swift': m.version('ms-swift'), 'transformers': m.version('transformers')}}))"
        % (ROOTS,)
    )
    info = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    return {k: Path(v) for k, v in info["dirs"].items()}, info["versions"]


def extract(python: str | None = None) -> dict:
    dirs, versions = _locate(python)
    index = SourceIndex(dirs)
    result: dict = {"ms_swift_version": versions["ms_swift"], "transformers_version": versions["transformers"]}
    for backend, (module, name) in ENTRY.items():
        if index.module(module) is None or name not in index.module(module).classes:
            raise SystemExit(f"{module}.{name} not found under {dirs['swift']}")
        result[backend] = sorted(collect_fields(index, ClassRef(module, name)))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=None)
    ap.add_argument("--output", default=str(DEFAULT_OUTPUT))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    result = extract(args.python)
    text = json.dumps(result, indent=1) + "\n"
    if args.check:
        same = json.loads(Path(args.output).read_text(encoding="utf-8")) == result
        print("up to date" if same else f"{args.output} differs from the installed ms-swift")
        return 0 if same else 1
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}: " + ", ".join(f"{b} {len(result[b])} flags" for b in ENTRY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
