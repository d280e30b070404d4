"""Long English documents from Debian's documentation packages, as one JSON-lines file.

    python scripts/long_corpus.py OUT_DIR [--min-chars 24000] [--max-chars 120000]
        [--root linux-doc=/usr/share/doc/linux-doc-6.1/html]

The pages of scripts/english_corpus.py (the main text of each Sphinx HTML page of ``linux-doc``
and ``python3-doc``, code blocks dropped) joined into long documents: the pages of one directory,
in sorted path order, make one document (a kernel subsystem's guide, a chapter of the Python
library reference). A directory whose text is shorter than ``--min-chars`` is joined to its
parent's; what is still shorter at the top is dropped. A document longer than ``--max-chars`` is
cut at page boundaries into parts of at least ``--min-chars``. At about 4.5 characters a token
(English prose, an 8,000-piece vocabulary), ``--min-chars 24000`` makes documents of 5,000+
tokens, so most rows of 4,096 tokens hold one document. Writes ``OUT_DIR/long.jsonl``
(``{"text", "source"}``, ``source`` = package:directory) and ``OUT_DIR/long_stats.json``.
Standard library only. Used by scripts/make_long_corpus.sh.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from english_corpus import ROOTS, find_root, page_text, pages  # noqa: E402


def cut_lines(text: str, max_chars: int) -> list[str]:
    """``text`` cut at line ends into pieces of at most ``max_chars`` (a longer line whole)."""
    pieces: list[list[str]] = [[]]
    size = 0
    for line in text.split("\n"):
        if pieces[-1] and size + len(line) + 1 > max_chars:
            pieces.append([])
            size = 0
        pieces[-1].append(line)
        size += len(line) + 1
    return ["\n".join(p) for p in pieces]


def directory_documents(texts: list[tuple[str, str]], min_chars: int, max_chars: int
                        ) -> list[tuple[str, str]]:  # fmt: skip
    """``[(directory, text)]`` of ``texts`` (``(relative page path, page text)``): pages joined
    per directory, short directories joined to their parent, long ones cut (see the module)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for rel, text in texts:
        for k, piece in enumerate(cut_lines(text, max_chars)):  # (a page longer than max_chars)
            groups.setdefault(os.path.dirname(rel), []).append((f"{rel}#{k:04d}", piece))

    # deepest first: a short directory's pages move up to its parent (in path order)
    def depth(d: str) -> int:
        return d.count("/") + 1 if d else 0

    for level in range(max(map(depth, groups), default=0), 0, -1):
        for d in sorted(g for g in groups if depth(g) == level):
            if sum(len(t) for _, t in groups[d]) < min_chars:
                groups.setdefault(os.path.dirname(d), []).extend(groups.pop(d))
    out = []
    for d in sorted(groups):
        items = sorted(groups[d])
        if sum(len(t) for _, t in items) < min_chars:
            continue
        parts: list[list[str]] = [[]]
        for _, text in items:
            if parts[-1] and sum(map(len, parts[-1])) + len(text) > max_chars:
                parts.append([])
            parts[-1].append(text)
        if len(parts) > 1 and sum(map(len, parts[-1])) < min_chars:
            parts[-2].extend(parts.pop())
        for k, part in enumerate(parts):
            out.append(((d or ".") + (f"#{k}" if len(parts) > 1 else ""), "\n\n".join(part)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (long.jsonl, long_stats.json)")
    ap.add_argument("--root", action="append", default=[],
                    help="PACKAGE=DIR: the HTML directory of a package (default: found)")  # fmt: skip
    ap.add_argument("--min-chars", type=int, default=24000, help="shortest document")
    ap.add_argument("--max-chars", type=int, default=120000, help="longest document (cut at "
                    "page boundaries)")  # fmt: skip
    ap.add_argument("--min-page-chars", type=int, default=200, help="skip pages with less text")
    args = ap.parse_args(argv)
    if not 0 < args.min_chars <= args.max_chars:
        print("long_corpus: need 0 < --min-chars <= --max-chars", file=sys.stderr)
        return 2
    roots: dict[str, str | None] = {p: find_root(p) for p in ROOTS}
    for item in args.root:
        name, _, path = item.partition("=")
        roots[name] = path
    missing = [p for p, r in roots.items() if not r or not os.path.isdir(r)]
    if missing:
        print(f"long_corpus: no HTML documentation of {', '.join(missing)} "
              f"(install: apt-get install {' '.join(missing)})", file=sys.stderr)  # fmt: skip
        return 1
    os.makedirs(args.out, exist_ok=True)
    stats: dict[str, dict[str, object]] = {}
    path = os.path.join(args.out, "long.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for package, root in roots.items():
            texts = []
            for rel in pages(root):
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as page:
                    text = page_text(page.read())
                if len(text) >= args.min_page_chars:
                    texts.append((rel, text))
            docs = directory_documents(texts, args.min_chars, args.max_chars)
            for d, text in docs:
                f.write(json.dumps({"text": text, "source": f"{package}:{d}"}) + "\n")
            sizes = sorted(len(t) for _, t in docs)
            stats[package] = {"root": root, "pages": len(texts), "documents": len(docs),
                              "characters": sum(sizes),
                              "median_characters": sizes[len(sizes) // 2] if sizes else 0,
                              "min_characters": sizes[0] if sizes else 0}  # fmt: skip
    os.replace(path + ".tmp", path)
    stats["total"] = {k: sum(s[k] for s in stats.values())  # type: ignore[misc]
                      for k in ("pages", "documents", "characters")}  # fmt: skip
    with open(os.path.join(args.out, "long_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
        f.write("\n")
    t = stats["total"]
    print(f"long_corpus: {t['documents']} documents, {t['characters']:,} characters from "
          f"{t['pages']} pages -> {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
