#!/usr/bin/env bash
# The English corpus of the GPU check (docs/gpu.md): the reStructuredText sources of Debian's
# Python documentation (python3.X-doc) and Linux kernel documentation (linux-doc-X), fetched with
# apt-get download (no root install), unpacked to data/english_docs/, then tokenized by the
# GPU quality sweep's own data step (studies/sweep.py ensure_data: one 16k SentencePiece
# tokenizer, shards for every N of configs/sweeps/gpu_quality.yaml) into gpu_carry/data/, which
# travels to the GPU machine. Prints the sizes. Needs apt-get and this checkout's venv.
#   usage: bash scripts/make_gpu_corpus.sh            (PY_DOC / LINUX_DOC: other package names)
set -euo pipefail
cd "$(dirname "$0")/.."
sweep_file=configs/sweeps/gpu_quality.yaml
src=data/english_docs
py=${PYTHON:-python}

# The versioned packages behind Debian's python3-doc / linux-doc meta packages.
dep_of() { apt-cache depends "$1" 2>/dev/null | awk -v p="$2" '$1 == "Depends:" && $2 ~ p {print $2; exit}'; }
PY_DOC=${PY_DOC:-$(dep_of python3-doc '^python3\\.[0-9]+-doc$')}
LINUX_DOC=${LINUX_DOC:-$(dep_of linux-doc '^linux-doc-[0-9]')}
if [ -z "$PY_DOC" ] || [ -z "$LINUX_DOC" ]; then
  echo "error: cannot resolve python3-doc / linux-doc (run apt-get update, or set PY_DOC and LINUX_DOC)" >&2
  exit 1
fi

if [ ! -f "$src/SOURCES.txt" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[corpus] apt-get download $PY_DOC $LINUX_DOC"
  (cd "$tmp" && apt-get download "$PY_DOC" "$LINUX_DOC" >/dev/null 2>&1) || {
    echo "error: apt-get download $PY_DOC $LINUX_DOC failed (apt-get update first?)" >&2
    exit 1
  }
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/root"; done
  dest=$PWD/$src.tmp
  rm -rf "$dest" && mkdir -p "$dest/python" "$dest/linux"
  # Python: the Sphinx sources shipped beside the HTML (one .rst.txt per page)
  pyroot=$(find "$tmp/root/usr/share/doc" -maxdepth 3 -type d -name _sources -path '*python3*' | head -1)
  (cd "$pyroot" && find . -name '*.rst.txt' -exec cp --parents {} "$dest/python" \;)
  # Linux: Documentation/**/*.rst.gz, decompressed; English only (not translations/)
  lxroot=$(find "$tmp/root/usr/share/doc" -maxdepth 2 -type d -name Documentation | head -1)
  (cd "$lxroot" && find . -path ./translations -prune -o -name '*.rst.gz' -print | while read -r f; do
    mkdir -p "$dest/linux/$(dirname "$f")"
    gzip -dc "$f" >"$dest/linux/${f%.gz}"
  done)
  printf '%s\n' "$(dpkg-deb -f "$tmp"/"$PY_DOC"_*.deb Package Version | paste -sd' ')" \
    "$(dpkg-deb -f "$tmp"/"$LINUX_DOC"_*.deb Package Version | paste -sd' ')" >"$src.tmp/SOURCES.txt"
  rm -rf "$src" && mv "$src.tmp" "$src"
fi
echo "[corpus] $src: $(find "$src" -type f -name '*.rst*' | wc -l) files, $(du -sh "$src" | cut -f1)" \
  "from $(paste -sd';' "$src/SOURCES.txt")"

# Tokenize through the sweep's data step, so the sweep finds the shards under its cache key.
"$py" - "$sweep_file" <<'PY'
import json
import sys
import time

sys.path.insert(0, ".")
from studies import sweep

cfg = sweep.load_sweep(sys.argv[1])
for n in sorted({p.seq_len for p in cfg.points()}):
    t0 = time.perf_counter()
    path = sweep.ensure_data(cfg.data, n, log=print)
    m = json.loads((path / "manifest.json").read_text())
    rows = {s: m["splits"][s]["rows"] for s in m["splits"]}
    print(f"[corpus] N={n}: {path} ({time.perf_counter() - t0:.0f}s) rows={rows}")
PY
echo "[corpus] carried: $(du -sh gpu_carry/data | cut -f1) in gpu_carry/data"
