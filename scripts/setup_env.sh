#!/usr/bin/env bash
# Create .venv (if missing) and install the project with every extra.
# torch==2.13.0 goes first: on CPU boxes it is the CPU build; a bare `torch` requirement
# would pull a multi-GB CUDA build. GPU users install the CUDA torch for their driver first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! python -c "import linformer_ds, deepspeed, omegaconf, datasets, sentencepiece, transformers, pytest, hypothesis" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  pip install -q -e ".[dev]"
  touch .venv/.installed
fi
