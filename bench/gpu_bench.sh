#!/usr/bin/env bash
# Training-step benchmark on one CUDA GPU (prepared for the device tool's H200; any GPU works).
# Full BERT-base depth (12 layers, hidden 768, 12 heads, k 256), bf16 params + fp32 master
# AdamW, 64k tokens per step (batch = 65536 / N), N = 512 .. 65536, dense through SDPA's fused
# (flash / memory-efficient) kernels. Needs only torch (>= 2.4) and this checkout; matplotlib
# is optional (without it, make the PNGs later: python -m bench.model_bench --replot DIR).
#   usage: bash bench/gpu_bench.sh [OUT_DIR [extra bench.model_bench options]]
#   (OUT_DIR defaults to bench/results/gpu; e.g. bash bench/gpu_bench.sh "$OUT" --compile)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu}"
shift || true  # the rest goes to bench.model_bench
mkdir -p "$out"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible: this script is for a GPU machine"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia-smi.txt" || true
plots=()
python -c "import matplotlib" 2>/dev/null || plots=(--no-plots)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m bench.model_bench --device cuda --layers 12 --tokens 65536 \
    --seq-lens 512 1024 2048 4096 8192 16384 32768 65536 \
    --warmup 3 --iters 10 --gemm-n 8192 --gemm-reps 20 --step-budget-s 20 \
    --out "$out" "${plots[@]}" "$@" 2>&1 | tee "$out/log.txt"
