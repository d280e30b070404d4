#!/usr/bin/env bash
# Training-step benchmark on one CUDA GPU (prepared for the device tool's H200; any GPU works).
# Full BERT-base depth (12 layers, hidden 768, 12 heads, k 256), bf16 params + fp32 master
# AdamW, 64k tokens per step (batch = 65536 / N), N = 512 .. 65536, dense through SDPA's fused
# (flash / memory-efficient) kernels. Needs only torch (>= 2.4) and this checkout; matplotlib
# is optional (without it, make the PNGs later: python -m bench.model_bench --replot DIR).
#   usage: bash bench/gpu_bench.sh [OUT_DIR [extra bench.model_bench options]]
#   (OUT_DIR defaults to bench/results/gpu; e.g. bash bench/gpu_bench.sh "$OUT" --compile)
#   A second pass times the linear variant compiled at N=4096 (OUT_DIR/compiled; see below).
#   Later options win: scripts/gpu_check.py trims the grid with --seq-lens/--iters, and its dry
#   run passes --device cpu and tiny sizes with GPU_BENCH_ALLOW_CPU=1. PYTHON: the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu}"
shift || true  # the rest goes to bench.model_bench
py="${PYTHON:-python3}"
mkdir -p "$out"
GPU_BENCH_ALLOW_CPU="${GPU_BENCH_ALLOW_CPU:-0}" "$py" - <<'PY'
import os
import torch
if os.environ["GPU_BENCH_ALLOW_CPU"] != "1":
    assert torch.cuda.is_available(), "no CUDA device visible: this script is for a GPU machine"
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
else:
    print(torch.__version__, "cuda" if torch.cuda.is_available() else "cpu (GPU_BENCH_ALLOW_CPU=1)")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee "$out/nvidia-smi.txt" || true
plots=()
"$py" -c "import matplotlib" 2>/dev/null || plots=(--no-plots)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
grid=(--device cuda --layers 12 --tokens 65536 --seq-lens 512 1024 2048 4096 8192 16384 32768 65536
      --warmup 3 --iters 10 --gemm-n 8192 --gemm-reps 20 --step-budget-s 20)
"$py" -m bench.model_bench "${grid[@]}" --out "$out" "${plots[@]}" "$@" 2>&1 | tee "$out/log.txt"
# Compiled vs eager: the linear variant again under torch.compile (inductor), in $out/compiled,
# at N = GPU_BENCH_COMPILE_SEQ_LENS (default 4096: one compilation). GPU_BENCH_COMPILE=0 skips it
# (the CPU dry run's default; =1 runs it there too), as does a first pass that was compiled
# already (--compile among the options).
[[ "${GPU_BENCH_ALLOW_CPU:-0}" == 1 ]] && compiled_pass=0 || compiled_pass=1
if [[ "${GPU_BENCH_COMPILE:-$compiled_pass}" == 1 && " $* " != *" --compile "* ]]; then
  mkdir -p "$out/compiled"
  "$py" -m bench.model_bench "${grid[@]}" --out "$out/compiled" "${plots[@]}" "$@" \
      --compile --variants linear --seq-lens ${GPU_BENCH_COMPILE_SEQ_LENS:-4096} 2>&1 |
      tee "$out/compiled/log.txt"
fi
