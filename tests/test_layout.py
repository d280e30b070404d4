"""The layout stays as documented: every module of the two packages imports (so the quick tier
touches each one), data_prep and linformer_ds.fsio stay torch-free (data_prep's worker
processes import them), and README's layout table names every module, script and tool."""

import importlib
import subprocess
import sys

import pytest

from tests.pretrain_utils import REPO

PACKAGES = ("linformer_ds", "data_prep")
DOCUMENTED = ("linformer_ds", "data_prep", "scripts", "bench", "studies", "launch")


def _modules(package: str) -> list:
    root = REPO / package
    return sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts)
        for p in root.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


@pytest.mark.parametrize("module", [m for pkg in PACKAGES for m in _modules(pkg)])
def test_every_module_imports(module):
    importlib.import_module(module)


def test_data_prep_and_fsio_do_not_load_torch():
    code = (
        "import sys, data_prep.pipeline, data_prep.parallel, linformer_ds.fsio; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_readme_layout_names_every_module_script_and_tool():
    text = (REPO / "README.md").read_text()
    layout = text[text.index("## Layout") : text.index("\n## ", text.index("## Layout") + 1)]
    missing = []
    for top in DOCUMENTED:
        for p in sorted((REPO / top).rglob("*")):
            if "__pycache__" in p.parts or p.name == "__init__.py" or not p.is_file():
                continue
            if p.suffix not in (".py", ".sh") or "results" in p.parts:
                continue
            if p.stem not in layout and p.name not in layout:
                missing.append(str(p.relative_to(REPO)))
    assert not missing, f"README's layout table does not name: {missing}"
