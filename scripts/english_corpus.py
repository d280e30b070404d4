"""Plain English documents from Debian's documentation packages, as one JSON-lines file.

    python scripts/english_corpus.py OUT_DIR [--root linux-doc=/usr/share/doc/linux-doc-6.1/html]

Reads the Sphinx HTML of the Linux kernel documentation (package ``linux-doc``, rendered from
its reStructuredText) and of the Python documentation (``python3-doc``), one document per page,
and writes ``OUT_DIR/english.jsonl`` (``{"text", "source"}`` records, in sorted path order) and
``OUT_DIR/english_stats.json`` (documents, characters, bytes per package). Text comes from the
page's main content (``role="main"``) through the standard library's ``html.parser``: code
blocks (``<pre>``), scripts, styles and permalink marks are dropped, block elements end lines,
whitespace inside a paragraph is collapsed (a paragraph is a line). Index, search and
module-index pages and the kernel's ``translations/`` (not English) are skipped, as are pages
with less than ``--min-chars`` of text. Standard library only. Used by
scripts/make_english_corpus.sh.
"""

import argparse
import glob
import json
import os
import re
import sys
from html.parser import HTMLParser

ROOTS = {  # package -> the directory of its HTML (the first one that exists)
    "linux-doc": ["/usr/share/doc/linux-doc/html", "/usr/share/doc/linux-doc-*/html"],
    "python3-doc": ["/usr/share/doc/python3/html", "/usr/share/doc/python3.*/html"],
}
SKIP_PAGE = re.compile(r"(^|/)(genindex[^/]*|search|py-modindex|np-modindex)\.html$")
SKIP_DIRS = ("_sources", "_static", "_images", "_downloads", "translations")  # not English
SKIP_TAGS = {"pre", "script", "style", "noscript", "template", "svg", "math"}
BLOCK_TAGS = {
    "p", "div", "section", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "td", "th",
    "h1", "h2", "h3", "h4", "h5", "h6", "br", "blockquote", "figure", "figcaption", "caption",
    "hr", "article", "aside", "header", "footer", "nav", "main",
}  # fmt: skip
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed",
             "source", "track", "wbr", "param"}  # fmt: skip


class MainText(HTMLParser):
    """The text of a Sphinx page's main content: lines at block boundaries, no code blocks."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open elements inside the main content (0: outside)
        self.skip = 0  # open elements of a skipped kind (code, script, permalink)
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        void = tag in VOID_TAGS
        if self.depth == 0:
            if a.get("role") == "main" and not void:
                self.depth = 1
            return
        if not void:
            self.depth += 1
        headerlink = tag == "a" and "headerlink" in (a.get("class") or "").split()
        if self.skip or tag in SKIP_TAGS or headerlink:
            if not void:
                self.skip += 1
            return
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.depth and not self.skip and tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.depth == 0 or tag in VOID_TAGS:
            return
        self.depth -= 1
        if self.skip:
            self.skip -= 1
            if self.skip == 0 and tag == "pre":
                self.parts.append("\n")
            return
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skip:
            self.parts.append(data.replace("\n", " "))  # source line breaks inside a block

    def text(self) -> str:
        """Paragraph lines with collapsed whitespace, blank runs removed."""
        lines = (" ".join(ln.split()) for ln in "".join(self.parts).split("\n"))
        return "\n".join(ln for ln in lines if ln and ln != "¶")


def page_text(html: str) -> str:
    """The main-content text of one HTML page (see :class:`MainText`)."""
    parser = MainText()
    parser.feed(html)
    parser.close()
    return parser.text()


def find_root(package: str) -> str | None:
    for pattern in ROOTS[package]:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def pages(root: str) -> list[str]:
    """The HTML pages under ``root`` (relative paths, sorted), without indices and assets."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(".html") and not SKIP_PAGE.search(rel):
                out.append(rel)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (english.jsonl, english_stats.json)")
    ap.add_argument("--root", action="append", default=[],
                    help="PACKAGE=DIR: the HTML directory of a package (default: found)")  # fmt: skip
    ap.add_argument("--min-chars", type=int, default=500, help="skip pages with less text")
    args = ap.parse_args(argv)
    roots: dict[str, str | None] = {p: find_root(p) for p in ROOTS}
    for item in args.root:
        name, _, path = item.partition("=")
        roots[name] = path
    missing = [p for p, r in roots.items() if not r or not os.path.isdir(r)]
    if missing:
        print(f"english_corpus: no HTML documentation of {', '.join(missing)} "
              f"(install: apt-get install {' '.join(missing)})", file=sys.stderr)  # fmt: skip
        return 1
    os.makedirs(args.out, exist_ok=True)
    stats: dict[str, dict[str, object]] = {}
    path = os.path.join(args.out, "english.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for package, root in roots.items():
            docs = chars = nbytes = skipped = 0
            for rel in pages(root):
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as page:
                    text = page_text(page.read())
                if len(text) < args.min_chars:
                    skipped += 1
                    continue
                f.write(json.dumps({"text": text, "source": f"{package}:{rel}"}) + "\n")
                docs += 1
                chars += len(text)
                nbytes += len(text.encode("utf-8"))
            stats[package] = {"root": root, "documents": docs, "characters": chars,
                              "text_bytes": nbytes, "pages_skipped_short": skipped}  # fmt: skip
    os.replace(path + ".tmp", path)
    stats["total"] = {k: sum(s[k] for s in stats.values())  # type: ignore[misc]
                      for k in ("documents", "characters", "text_bytes")}  # fmt: skip
    with open(os.path.join(args.out, "english_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    t = stats["total"]
    print(f"english_corpus: {t['documents']} documents, {t['text_bytes'] / 1e6:.1f} MB of text "
          f"-> {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
