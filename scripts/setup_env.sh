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
# The mlflow extra for the tracker test (tests/test_extending.py puts it on its trainer's path),
# installed beside the environment, not in it: with mlflow importable, every `import deepspeed`
# imports it (deepspeed.autotuning) and takes 1.1-1.3 s longer (3.47 s against 2.18-2.49 s),
# paid by each of the suite's hundreds of rank and launcher processes.
if [ ! -f .venv/mlflow-site/.installed ] || [ constraints.txt -nt .venv/mlflow-site/.installed ]; then
  rm -rf .venv/mlflow-site
  pip install -q -c .venv/constraints.txt --target .venv/mlflow-site \
    "mlflow-skinny>=2.10" "sqlalchemy>=2.0" "alembic>=1.10"
  touch .venv/mlflow-site/.installed
fi
