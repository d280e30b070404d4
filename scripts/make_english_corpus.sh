#!/usr/bin/env bash
# An English corpus on any Debian machine, in one command:
#   bash scripts/make_english_corpus.sh OUT [data_prep options, e.g. --seq-len 1024]
# 1. installs Debian's documentation packages linux-doc and python3-doc when missing (as root;
#    otherwise it says what to install and stops);
# 2. extracts one plain-text document per HTML page (scripts/english_corpus.py: the pages' main
#    text through html.parser, code blocks dropped) -> OUT/text/english.jsonl + english_stats.json;
# 3. runs data_prep on it -> OUT/data (SentencePiece unigram, vocab 8000, N = 512,
#    --packing full), the data of configs/english_cpu.yaml's last stage (data/english/data);
# 4. the same text at N = 64 and N = 128 with that tokenizer -> OUT/data64, OUT/data128 (its
#    first two stages): the same documents in the same splits (one split seed), cut into rows
#    of 64 and 128.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/make_english_corpus.sh OUT [data_prep options]}
shift
PACKAGES=(linux-doc python3-doc)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "make_english_corpus: ${missing[*]} not installed; as root run: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "make_english_corpus: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then  # an active virtual environment is used as it is
  bash scripts/setup_env.sh
  . .venv/bin/activate
fi
python scripts/english_corpus.py "$OUT/text"
python -m data_prep --source "$OUT/text/english.jsonl" --text-column text --out "$OUT/data" \
  --seq-len 512 --vocab-size 8000 --packing full "$@"
python -m data_prep --source "$OUT/text/english.jsonl" --text-column text --out "$OUT/data128" \
  --seq-len 128 --tokenizer "$OUT/data/tokenizer.model" --packing full
python -m data_prep --source "$OUT/text/english.jsonl" --text-column text --out "$OUT/data64" \
  --seq-len 64 --tokenizer "$OUT/data/tokenizer.model" --packing full
