"""The package's shape in numbers: module sizes, import cycles, imports inside functions, the
longest functions.

    python scripts/arch_report.py [ROOT]          # a markdown summary of ROOT (default: the repo)
    python scripts/arch_report.py --json [ROOT]   # the same as JSON

It reads the source with ``ast`` (nothing is imported), so it runs on any checkout, an old
commit's worktree included. ``tests/test_import_graph.py`` uses :func:`import_graph` and
:func:`cycles` to fail on any import cycle, lazy imports (inside functions) included.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("linformer_ds", "data_prep")


@dataclass
class Module:
    name: str  # dotted, e.g. linformer_ds.checkpoint.io
    path: Path
    lines: int
    is_package: bool  # an __init__.py
    imports: list[tuple[str, bool]] = field(default_factory=list)  # (module, inside a function)
    functions: list[tuple[str, int]] = field(default_factory=list)  # (qualified name, lines)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _walk(node: ast.AST, in_function: bool, prefix: str) -> Iterator[tuple[ast.AST, bool, str]]:
    for child in ast.iter_child_nodes(node):
        yield child, in_function, prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(child, True, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, in_function, f"{prefix}{child.name}.")
        else:
            yield from _walk(child, in_function, prefix)


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def parse(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Module]:
    """Every module of ``packages`` under ``root`` with its project-internal imports."""
    mods: dict[str, Module] = {}
    trees = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            name = module_name(root, path)
            mods[name] = Module(
                name, path, text.count("\n") + (not text.endswith("\n")), path.name == "__init__.py"
            )
            trees[name] = ast.parse(text, filename=str(path))
    for name, tree in trees.items():
        mod = mods[name]
        for node, in_fn, prefix in _walk(tree, False, ""):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.functions.append((prefix + node.name, node.end_lineno - node.lineno + 1))
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node)
                # `from pkg import sub` imports the module pkg.sub when there is one
                subs = [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in mods]
                targets = subs or [src]
            else:
                continue
            for t in targets:
                mod.imports.append((t, in_fn))
    return mods


def import_graph(mods: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at the top or inside functions). An import of
    ``a.b.c`` counts as an edge to the deepest project module on that path."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, mod in mods.items():
        for target, _ in mod.imports:
            parts = target.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts and ".".join(parts) != m:
                graph[m].add(".".join(parts))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between top-level packages (linformer_ds <-> data_prep)."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        a = m.split(".")[0]
        out.setdefault(a, set())
        out[a] |= {t.split(".")[0] for t in targets if t.split(".")[0] != a}
    return out


def report(root: Path) -> dict:
    mods = parse(root)
    graph = import_graph(mods)
    n_imports = sum(len(m.imports) for m in mods.values())
    lazy = sum(1 for m in mods.values() for _, f in m.imports if f)
    funcs = sorted(
        ((f"{m.name}.{q}", n) for m in mods.values() for q, n in m.functions), key=lambda x: -x[1]
    )
    return {
        "modules": {m.name: m.lines for m in sorted(mods.values(), key=lambda m: -m.lines)},
        "cycles": cycles(graph),
        "package_cycles": cycles(package_graph(graph)),
        "project_imports": n_imports,
        "project_imports_in_functions": lazy,
        "longest_functions": funcs[:10],
    }


def _all_imports(root: Path) -> tuple[int, int]:
    """All import statements (any module) and those inside functions, over both packages."""
    total = inside = 0
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node, in_fn, _ in _walk(tree, False, ""):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    total += 1
                    inside += in_fn
    return total, inside


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.root)
    rep = report(root)
    rep["import_statements"], rep["import_statements_in_functions"] = _all_imports(root)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    big = {k: v for k, v in rep["modules"].items() if v > 600}
    print(
        f"modules: {len(rep['modules'])}; over 600 lines: "
        + (", ".join(f"{k} {v}" for k, v in big.items()) or "none")
    )
    print(f"import cycles: {len(rep['cycles'])}")
    for c in rep["cycles"]:
        print("  " + " <-> ".join(c))
    print(f"package cycles: {rep['package_cycles'] or 'none'}")
    s, i = rep["import_statements"], rep["import_statements_in_functions"]
    print(f"import statements inside functions: {i} of {s} ({100 * i / max(s, 1):.0f} %)")
    print("longest functions: " + ", ".join(f"{q} {n}" for q, n in rep["longest_functions"][:5]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
