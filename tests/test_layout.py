"""The layout stays as documented: every module of the two packages imports (so the quick tier
touches each one), data_prep and linformer_ds.fsio stay torch-free (data_prep's worker
processes import them), docs/development.md's layout table names every module, script and tool,
every document is reachable from the README through docs/README.md, and every .md under docs/
(the study reports included) is reachable from the README by links."""

import importlib
import re
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


def test_layout_doc_names_every_module_script_and_tool():
    text = (REPO / "docs" / "development.md").read_text()
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
    assert not missing, f"docs/development.md's layout table does not name: {missing}"


def _links(path) -> set:
    """The local targets of a markdown file's links, resolved (anchors dropped)."""
    out = set()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            out.add((path.parent / target).resolve())
    return out


def test_every_doc_is_reachable_from_the_readme():
    index = REPO / "docs" / "README.md"
    assert index.resolve() in _links(REPO / "README.md")
    linked = _links(index)
    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "BENCHMARKS.md", REPO / "CHANGELOG.md"]
    missing = [str(p.relative_to(REPO)) for p in docs if p != index and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link: {missing}"
    broken = [str(p) for p in linked | _links(REPO / "README.md") if not p.exists()]
    assert not broken, f"links to nothing: {broken}"


def test_every_markdown_under_docs_is_reachable_from_the_readme_by_links():
    """Follow local links from README.md (a markdown file's links, a linked folder's README.md):
    every .md under docs/ is reached and no followed link points at nothing."""
    seen, todo, broken = set(), [(REPO / "README.md").resolve()], []
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in _links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
            elif target.suffix == ".md":
                todo.append(target)
            elif target.is_dir() and (target / "README.md").exists():
                todo.append(target / "README.md")
    unlinked = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "docs").rglob("*.md"))
        if p.resolve() not in seen
    ]
    assert not unlinked, f"no chain of links from README.md reaches: {unlinked}"
    assert not broken, f"links to nothing: {broken}"
