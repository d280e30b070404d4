"""The package's layout: no import cycles (imports inside functions included), no cycle between
linformer_ds and data_prep, no module over its size budget (docs/module_budget.md), the model
package torch-only (scripts/arch_report.py)."""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("arch_report", ROOT / "scripts" / "arch_report.py")
arch = importlib.util.module_from_spec(_spec)
sys.modules["arch_report"] = arch
_spec.loader.exec_module(arch)

BUDGET_FILE = ROOT / "docs" / "module_budget.md"
BUDGETED = ("linformer_ds", "data_prep", "launch")  # not tests/ nor bench/
DEFAULT_LINES = 500  # a module over this needs a row in BUDGET_FILE


@pytest.fixture(scope="module")
def mods():
    return arch.parse(ROOT)


def test_no_import_cycles(mods):
    found = arch.cycles(arch.import_graph(mods))
    assert found == [], "import cycles (lazy imports included): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_package_cycle(mods):
    graph = arch.package_graph(arch.import_graph(mods))
    assert arch.cycles(graph) == [], f"linformer_ds and data_prep import each other: {graph}"


def _lines(path: Path) -> int:
    text = path.read_text(encoding="utf-8")
    return text.count("\n") + (not text.endswith("\n"))


def read_budget(text: str) -> dict:
    """``{path: (budget, why)}`` from the rows ``| `path` | lines | why |`` of the budget file."""
    rows = re.findall(r"^\| `([^`]+\.py)` \| *(\d+) *\| *(.*?) *\|$", text, re.M)
    budget = {}
    for path, lines, why in rows:
        assert path not in budget, f"{BUDGET_FILE.name}: {path} has two rows"
        assert why, f"{BUDGET_FILE.name}: {path} says not why it is over {DEFAULT_LINES} lines"
        budget[path] = (int(lines), why)
    return budget


def budget_problems(root: Path, budget: dict) -> list:
    """What breaks the budget: a module over 500 lines without a row, one over its row's budget,
    a row for a module that is gone or back under 500 lines."""
    sizes = {
        p.relative_to(root).as_posix(): _lines(p)
        for top in BUDGETED
        for p in sorted((root / top).rglob("*.py"))
        if "__pycache__" not in p.parts
    }
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


def test_module_sizes_within_budget():
    problems = budget_problems(ROOT, read_budget(BUDGET_FILE.read_text(encoding="utf-8")))
    assert problems == [], f"{BUDGET_FILE.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_budget_check_catches_each_case(tmp_path):
    """The check itself, on a made-up tree: an unlisted big module, one over its budget, a row
    for a module that is gone, a row for one back under the default; a listed one within."""
    for name, lines in {"big": 501, "over": 620, "within": 590, "small": 100}.items():
        (tmp_path / "linformer_ds").mkdir(exist_ok=True)
        (tmp_path / "linformer_ds" / f"{name}.py").write_text("x = 1\n" * lines)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "huge.py").write_text("x = 1\n" * 900)  # not budgeted
    table = "\n".join(
        f"| `linformer_ds/{n}.py` | {b} | a reason |"
        for n, b in (("over", 600), ("within", 600), ("gone", 700), ("small", 600))
    )
    problems = budget_problems(tmp_path, read_budget(table))
    assert problems == [
        "linformer_ds/big.py: 501 lines, over 500 with no row",
        "linformer_ds/over.py: 620 lines, over its budget of 600",
        "linformer_ds/gone.py: in the budget but not a module of linformer_ds, data_prep, launch",
        "linformer_ds/small.py: 100 lines, under 500: remove its row",
    ]
    with pytest.raises(AssertionError, match="not why"):
        read_budget("| `linformer_ds/big.py` | 600 |  |")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "linformer_ds" / "model").glob("*.py")), ids=lambda p: p.name
)
def test_model_files_are_torch_only(path):
    """Every file of linformer_ds/model/ ships unchanged in every export (flat, as remote code):
    torch, the standard library and its siblings (one-dot relative imports) only."""
    siblings = {p.stem for p in path.parent.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module in siblings, (path.name, node.module)
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names - set(sys.stdlib_module_names) <= {"torch"}, names


def test_the_checker_finds_a_cycle(tmp_path):
    """The checker itself: a lazy import that closes a cycle is found."""
    pkg = tmp_path / "linformer_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from linformer_ds import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (tmp_path / "data_prep").mkdir()
    (tmp_path / "data_prep" / "__init__.py").write_text("import linformer_ds.a\n")
    mods = arch.parse(tmp_path)
    assert arch.cycles(arch.import_graph(mods)) == [["linformer_ds.a", "linformer_ds.b"]]
    assert mods["linformer_ds.b"].imports == [("linformer_ds.a", True)]
