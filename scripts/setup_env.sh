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
# Every other dependency at the tested version (constraints.txt, what CI runs); the torch pin is
# dropped when another torch is already installed (a GPU user's CUDA build), which the trainer
# then checks against its tested range (linformer_ds/versions.py).
if ! python -c "import linformer_ds, deepspeed, omegaconf, datasets, sentencepiece, transformers, pytest, hypothesis, onnxruntime, onnxscript" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ] || [ constraints.txt -nt .venv/.installed ]; then
  torch_now=$(python -c "import torch; print(torch.__version__.split('+')[0])")
  if grep -qx "torch==$torch_now" constraints.txt; then
    cp constraints.txt .venv/constraints.txt
  else
    grep -v '^torch==' constraints.txt > .venv/constraints.txt
  fi
  pip install -q -c .venv/constraints.txt -e ".[dev]"
  touch .venv/.installed
fi
