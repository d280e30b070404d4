#!/bin/bash
# usage: q4096.sh NAME KINDSPEC [NAME KINDSPEC ...]: sequential probe runs at N=4096
cd /work/main
while [ $# -gt 1 ]; do
  d=studies/capability/fair_probe/s4096t2400_$1; mkdir -p $d
  a="--kinds $2 --seq-len 4096 --steps 2400 --batch 1 --queries 8 --curriculum 0.5 --curriculum-batch tokens --eval-rows 32 --tasks induction --items 32 --keys 32 --values 16 --filler 1"
  echo "$a" > $d/args
  .venv/bin/python -m linformer_ds.capability --threads 1 probe $a --out $d > $d/stdout.txt 2> $d/progress.log
  shift 2
done
