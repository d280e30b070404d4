"""The package's layout: no import cycles (imports inside functions included), no cycle between
linformer_ds and data_prep, no oversized module, model.py torch-only (scripts/arch_report.py)."""

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

MAX_LINES = 600  # issue 28: no module of linformer_ds over ~600 lines except model.py
EXEMPT = {"linformer_ds.model"}  # shipped verbatim in exports as one file


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


def test_module_sizes(mods):
    big = {
        m.name: m.lines
        for m in mods.values()
        if m.name.startswith("linformer_ds") and m.lines > MAX_LINES and m.name not in EXEMPT
    }
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


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
