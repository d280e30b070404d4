"""The package's shape in numbers: module sizes against their budget, import cycles (between
modules, between linformer_ds's subpackages, between the packages), imports inside functions,
the longest functions.

    python scripts/arch_report.py [ROOT]          # a markdown summary of ROOT (default: the repo)
    python scripts/arch_report.py --json [ROOT]   # the same as JSON

It reads the source with ``ast`` (nothing is imported), so it runs on any checkout, an old
commit's worktree included. The size budget is ROOT's docs/module_budget.md (:func:`read_budget`),
the one list of modules allowed over 500 lines. ``tests/test_import_graph.py`` uses
:func:`import_graph`, :func:`package_graph`, :func:`cycles` and :func:`budget_problems` to fail
on any import cycle (lazy imports, inside functions, included) and any module over its budget.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("linformer_ds", "data_prep")
BUDGET_FILE = Path("docs") / "module_budget.md"  # under ROOT
BUDGETED = ("linformer_ds", "data_prep", "launch")  # not tests/ nor bench/
DEFAULT_LINES = 500  # a module over this needs a row in BUDGET_FILE


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


def package_graph(graph: dict[str, set[str]], depth: int = 1) -> dict[str, set[str]]:
    """The same graph between packages. ``depth`` 1: the top-level packages (linformer_ds <->
    data_prep); 2: their parts, each subpackage one node (``linformer_ds.data``) and each
    top-level module its own (``linformer_ds.engine``)."""

    def part(m: str) -> str:
        return ".".join(m.split(".")[:depth])

    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        a = part(m)
        out.setdefault(a, set())
        out[a] |= {part(t) for t in targets if part(t) != a}
    return out


def subpackage_cycles(graph: dict[str, set[str]], package: str = "linformer_ds") -> list[list[str]]:
    """The cycles between ``package``'s parts (:func:`package_graph` at depth 2): a knot that
    no single module shows (e.g. data -> engine -> parallel -> data, each through another file)."""
    parts = package_graph(graph, depth=2)
    inside = {p: {t for t in ts if t.startswith(package + ".")}
              for p, ts in parts.items() if p.startswith(package + ".")}  # fmt: skip
    return cycles(inside)


# ================================================================================ size budget
def _lines(path: Path) -> int:
    text = path.read_text(encoding="utf-8")
    return text.count("\n") + (not text.endswith("\n"))


def read_budget(text: str) -> dict[str, tuple[int, str]]:
    """``{path: (budget, why)}`` from the rows ``| `path` | lines | why |`` of the budget file."""
    rows = re.findall(r"^\| `([^`]+\.py)` \| *(\d+) *\| *(.*?) *\|$", text, re.M)
    budget: dict[str, tuple[int, str]] = {}
    for path, lines, why in rows:
        assert path not in budget, f"{BUDGET_FILE.name}: {path} has two rows"
        assert why, f"{BUDGET_FILE.name}: {path} says not why it is over {DEFAULT_LINES} lines"
        budget[path] = (int(lines), why)
    return budget


def module_sizes(root: Path) -> dict[str, int]:
    """Lines of every budgeted module (``BUDGETED``), by path relative to ``root``."""
    return {
        p.relative_to(root).as_posix(): _lines(p)
        for top in BUDGETED
        for p in sorted((root / top).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def budget_problems(root: Path, budget: dict[str, tuple[int, str]]) -> list[str]:
    """What breaks the budget: a module over 500 lines without a row, one over its row's budget,
    a row for a module that is gone or back under 500 lines."""
    sizes = module_sizes(root)
    problems = []
    for path, lines in sizes.items():
        allowed = budget[path][0] if path in budget else DEFAULT_LINES
        if lines > allowed:
            where = f"its budget of {allowed}" if path in budget else f"{DEFAULT_LINES} with no row"
            problems.append(f"{path}: {lines} lines, over {where}")
    for path in budget:
        if path not in sizes:
            problems.append(f"{path}: in the budget but not a module of {', '.join(BUDGETED)}")
        elif sizes[path] <= DEFAULT_LINES:
            problems.append(f"{path}: {sizes[path]} lines, under {DEFAULT_LINES}: remove its row")
    return problems


def report(root: Path) -> dict:
    mods = parse(root)
    graph = import_graph(mods)
    n_imports = sum(len(m.imports) for m in mods.values())
    lazy = sum(1 for m in mods.values() for _, f in m.imports if f)
    funcs = sorted(
        ((f"{m.name}.{q}", n) for m in mods.values() for q, n in m.functions), key=lambda x: -x[1]
    )
    budget_path = root / BUDGET_FILE
    budget = read_budget(budget_path.read_text(encoding="utf-8")) if budget_path.exists() else {}
    sizes = module_sizes(root)
    return {
        "modules": {m.name: m.lines for m in sorted(mods.values(), key=lambda m: -m.lines)},
        "over_default": {
            p: {"lines": n, "budget": budget.get(p, (DEFAULT_LINES, ""))[0]}
            for p, n in sorted(sizes.items(), key=lambda x: -x[1])
            if n > DEFAULT_LINES
        },
        "budget_problems": budget_problems(root, budget),
        "cycles": cycles(graph),
        "subpackage_cycles": subpackage_cycles(graph),
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
    over = rep["over_default"]
    print(
        f"modules: {len(rep['modules'])}; over {DEFAULT_LINES} lines ({BUDGET_FILE.as_posix()}): "
        + (", ".join(f"{k} {v['lines']}/{v['budget']}" for k, v in over.items()) or "none")
    )
    for problem in rep["budget_problems"]:
        print(f"  budget: {problem}")
    print(f"import cycles: {len(rep['cycles'])}")
    for c in rep["cycles"]:
        print("  " + " <-> ".join(c))
    print(f"subpackage cycles: {rep['subpackage_cycles'] or 'none'}")
    print(f"package cycles: {rep['package_cycles'] or 'none'}")
    s, i = rep["import_statements"], rep["import_statements_in_functions"]
    print(f"import statements inside functions: {i} of {s} ({100 * i / max(s, 1):.0f} %)")
    print("longest functions: " + ", ".join(f"{q} {n}" for q, n in rep["longest_functions"][:5]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
