"""scripts/english_corpus.py: the main text of Sphinx pages (no code, navigation or permalink
marks), one JSON record per page, index pages and translations left out."""

import json
import subprocess
import sys

from tests.pretrain_utils import REPO

sys.path.insert(0, str(REPO / "scripts"))
from english_corpus import page_text  # noqa: E402

PAGE = """<html><head><title>t</title><script>var x = 1;</script></head><body>
<div class="sphinxsidebar">Navigation: Table of Contents</div>
<div class="body" role="main">
<h1>Memory management<a class="headerlink" href="#m">¶</a></h1>
<p>The kernel allocates memory
   for each <code><span class="pre">new</span></code> process.<br/>It frees it later.</p>
<div class="highlight"><pre>int x = kmalloc(16, GFP_KERNEL);</pre></div>
<ul><li><p>one &amp; two</p></li><li>three<img src="a.png"></li></ul>
</div>
<div class="footer">Copyright</div></body></html>"""


def test_page_text_keeps_the_main_prose_only():
    assert page_text(PAGE).split("\n") == [
        "Memory management",
        "The kernel allocates memory for each new process.",
        "It frees it later.",
        "one & two",
        "three",
    ]


def test_corpus_file_from_package_directories(tmp_path):
    linux, python = tmp_path / "linux", tmp_path / "python"
    for d in (linux / "sub", linux / "translations" / "it_IT", linux / "_static", python):
        d.mkdir(parents=True)
    body = PAGE.replace("later.", "later. " + "More prose here. " * 40)
    (linux / "sub" / "mm.html").write_text(body)
    (linux / "index.html").write_text(body.replace("Memory", "Index"))
    (linux / "genindex.html").write_text(body)
    (linux / "translations" / "it_IT" / "mm.html").write_text(body)
    (linux / "_static" / "x.html").write_text(body)
    (linux / "short.html").write_text(PAGE)  # under --min-chars
    (python / "os.html").write_text(body.replace("kernel", "interpreter"))
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "english_corpus.py"), str(out),
           "--root", f"linux-doc={linux}", "--root", f"python3-doc={python}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "3 documents" in proc.stdout
    docs = [json.loads(line) for line in (out / "english.jsonl").read_text().splitlines()]
    assert [d["source"] for d in docs] == [
        "linux-doc:index.html", "linux-doc:sub/mm.html", "python3-doc:os.html"
    ]  # fmt: skip
    assert "interpreter allocates" in docs[2]["text"] and "kmalloc" not in docs[1]["text"]
    stats = json.loads((out / "english_stats.json").read_text())
    assert stats["linux-doc"]["documents"] == 2 and stats["linux-doc"]["pages_skipped_short"] == 1
    assert stats["total"]["text_bytes"] == sum(len(d["text"].encode()) for d in docs)
