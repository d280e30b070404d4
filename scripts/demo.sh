#!/usr/bin/env bash
# The main job on an embedded default: set up .venv, build the stdlib corpus into a
# SentencePiece tokenizer + packed shards, pretrain the tiny config with 2 CPU ranks under the
# deepspeed launcher (ZeRO-2), print where the logs and checkpoint are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export DS_ACCELERATOR=cpu
DATA=${DATA:-data/stdlib}
RUN=${RUN:-runs/demo-$(date +%Y%m%d-%H%M%S)}
if [ ! -f "$DATA/manifest.json" ]; then
  RESUME=""
  if [ -f "$DATA/progress.json" ]; then RESUME="--resume"; fi  # an interrupted earlier run
  python -m data_prep --source stdlib --out "$DATA" --seq-len 256 --vocab-size 8000 $RESUME
fi
deepspeed --num_gpus 2 --master_port "${MASTER_PORT:-29511}" launch/pretrain.py \
  --config configs/tiny_cpu.yaml data.path="$DATA" logging.dir="$RUN" "$@"
