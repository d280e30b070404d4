"""The package's layout: no import cycles (imports inside functions included), no cycle between
linformer_ds's subpackages nor between linformer_ds and data_prep, no module over its size
budget (docs/module_budget.md), the model package torch-only (scripts/arch_report.py)."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("arch_report", ROOT / "scripts" / "arch_report.py")
arch = importlib.util.module_from_spec(_spec)
sys.modules["arch_report"] = arch
_spec.loader.exec_module(arch)

BUDGET_FILE = ROOT / arch.BUDGET_FILE


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


def test_no_cycle_between_subpackages(mods):
    """linformer_ds read as parts (each subpackage one node, each top-level module its own),
    from the real imports: no part imports itself back through others."""
    found = arch.subpackage_cycles(arch.import_graph(mods))
    assert found == [], "linformer_ds's subpackages import each other: " + "; ".join(
        " -> ".join(c) for c in found
    )


def test_the_checker_finds_a_subpackage_cycle(tmp_path):
    """The check itself: data -> engine -> parallel -> data, each edge from another module (no
    module cycle), is a cycle of parts; the same tree without the last edge is none."""
    pkg = tmp_path / "linformer_ds"
    for sub in ("data", "parallel"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "masking.py").write_text("from linformer_ds.engine import reduce\n")
    (pkg / "engine.py").write_text("from linformer_ds.parallel.groups import build\n")
    (pkg / "parallel" / "groups.py").write_text("build = 1\n")
    (pkg / "parallel" / "scaling.py").write_text("from linformer_ds.data.masking import IGNORE\n")
    (tmp_path / "data_prep").mkdir()
    graph = arch.import_graph(arch.parse(tmp_path))
    assert arch.cycles(graph) == []  # no module cycle
    assert arch.subpackage_cycles(graph) == [
        ["linformer_ds.data", "linformer_ds.engine", "linformer_ds.parallel"]
    ]
    (pkg / "parallel" / "scaling.py").write_text("IGNORE = -100\n")
    assert arch.subpackage_cycles(arch.import_graph(arch.parse(tmp_path))) == []


def test_module_sizes_within_budget():
    problems = arch.budget_problems(ROOT, arch.read_budget(BUDGET_FILE.read_text(encoding="utf-8")))
    assert problems == [], f"{BUDGET_FILE.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_report_reads_the_budget_file():
    """scripts/arch_report.py lists the modules over 500 lines with the budget of their row in
    docs/module_budget.md (no list of its own)."""
    rep = arch.report(ROOT)
    budget = arch.read_budget(BUDGET_FILE.read_text(encoding="utf-8"))
    assert rep["budget_problems"] == []
    assert {p: v["budget"] for p, v in rep["over_default"].items()} == {
        p: b for p, (b, _) in budget.items()
    }


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
    problems = arch.budget_problems(tmp_path, arch.read_budget(table))
    assert problems == [
        "linformer_ds/big.py: 501 lines, over 500 with no row",
        "linformer_ds/over.py: 620 lines, over its budget of 600",
        "linformer_ds/gone.py: in the budget but not a module of linformer_ds, data_prep, launch",
        "linformer_ds/small.py: 100 lines, under 500: remove its row",
    ]
    with pytest.raises(AssertionError, match="not why"):
        arch.read_budget("| `linformer_ds/big.py` | 600 |  |")


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


def test_the_trainer_module_leaves_the_process_alone(mods):
    """linformer_ds/trainer.py touches no signal and starts no watchdog (linformer_ds/train.py,
    the command line, does both and hands them in); it imports no test hook (they are passed in:
    ``Trainer(hooks=...)``)."""
    path = ROOT / "linformer_ds" / "trainer.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imported = {t for t, _ in mods["linformer_ds.trainer"].imports}
    bad = {t for t in imported if t == "signal" or t.startswith("linformer_ds.testing")}
    assert bad == set(), f"trainer.py imports {bad}"
    assert "signal" not in names, "trainer.py names the signal module"
    assert not (names | attrs) & {"start_watchdog", "set_wakeup_fd", "SignalFlag"}


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
