#!/usr/bin/env bash
# A long-document corpus (documents of 4,096+ tokens; most rows of N = 4,096 one document), in
# one command:
#   bash scripts/make_long_corpus.sh OUT [data_prep options]
#   bash scripts/make_long_corpus.sh OUT --source FILE.jsonl|hf:NAME[:CONFIG][:SPLIT] [--text-column C] [...]
# Without --source:
# 1. installs Debian's documentation packages linux-doc and python3-doc when missing (as root;
#    otherwise it says what to install and stops);
# 2. joins their pages into long documents, one per documentation directory (a kernel
#    subsystem's guide, a chapter of the Python library reference; scripts/long_corpus.py)
#    -> OUT/text/long.jsonl + long_stats.json;
# With --source: the user's documents (JSONL, CSV, Parquet, text files or a Hugging Face
# dataset, as data_prep reads them; e.g. PG-19-like books), as they are.
# 3. runs data_prep -> OUT/data (SentencePiece unigram, vocab 8000, N = 4096, --packing full,
#    --valid-fraction 0.05; any data_prep option given after OUT overrides these). data_prep's
#    summary and the manifest's documents_in_rows record say which share of rows holds a single
#    document and the document length distribution (min / median / p90 / max tokens).
# 4. checks the valid split (scripts/long_split.py): warns with counts when documents are
#    shorter than N, and counts the valid rows whose N tokens are one document (what
#    context_curve and capability copy score: up to 64 and 16 by default). Fewer than 64 and no
#    --valid-fraction given: data_prep runs again (--overwrite) with the larger fraction the
#    corpus's whole rows call for, at most 0.25 of the documents; a --valid-fraction given is
#    kept and the script says what to pass. Exit 1 when the valid split has no such row.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/make_long_corpus.sh OUT [--source SRC ...] [data_prep options]}
shift
own_source=0
for a in "$@"; do [ "$a" = "--source" ] && own_source=1; done
if [ "$own_source" = 0 ]; then
  PACKAGES=(linux-doc python3-doc)
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
      echo "make_long_corpus: ${missing[*]} not installed; as root run: apt-get install -y ${missing[*]}" >&2
      exit 1
    fi
    echo "make_long_corpus: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" \
      || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
  fi
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then  # an active virtual environment is used as it is
  bash scripts/setup_env.sh
  . .venv/bin/activate
fi
if [ "$own_source" = 0 ]; then
  python scripts/long_corpus.py "$OUT/text"
  set -- --source "$OUT/text/long.jsonl" --text-column text "$@"
fi
fixed=  # a --valid-fraction of the user's is kept (long_split.py then only advises)
rerun=()  # the user's options for a rerun (--resume dropped: a rerun starts over)
for a in "$@"; do
  case "$a" in --valid-fraction|--valid-fraction=*) fixed=--fixed ;; esac
  [ "$a" = "--resume" ] || rerun+=("$a")
done
fraction=0.05
prep() {
  python -m data_prep --out "$OUT/data" --seq-len 4096 --vocab-size 8000 --packing full \
    --valid-fraction "$fraction" "$@"
}
prep "$@"
for _ in 1 2 3 4 5; do  # the fraction grows 1.5x or more per rerun, up to 0.25: 4 at most
  rc=0
  next=$(python scripts/long_split.py "$OUT/data" $fixed) || rc=$?
  [ -n "$next" ] || exit "$rc"
  fraction=$next
  prep --overwrite ${rerun[@]+"${rerun[@]}"}
done
