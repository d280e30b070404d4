#!/usr/bin/env bash
# The GPU check (docs/gpu.md): installs the carried wheels (gpu_carry/wheels, made here by
# scripts/make_wheelhouse.sh) into a private folder, then runs scripts/gpu_check.py: GPU tests,
# the main job, the model-speed benchmark and the quality sweep, each under a hard time budget,
# 9 minutes in all. Results land in OUT (results.json, report.md, artifacts.tar.gz and this
# script's log gpu_check.log) even when a step fails.
#   usage: bash scripts/gpu_check.sh OUT [--dry-run] [scripts/gpu_check.py options]
#   --dry-run: CPU, tiny sizes, no wheels, no time limit (CI runs it: tests/test_gpu_kit.py)
#   PYTHON: the interpreter (default python3: the device image's, which holds CUDA torch)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: bash scripts/gpu_check.sh OUT [--dry-run] [scripts/gpu_check.py options]" >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out" || exit 2
dry=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry=1; done
py=${PYTHON:-python3}
hard_limit=${GPU_CHECK_HARD_LIMIT_S:-575}  # the device allows 600 s per command

{
  echo "[gpu_check.sh] $(date -u +%FT%TZ) on $(hostname), dry_run=$dry, python: $(command -v "$py")"
  if [ "$dry" = 0 ]; then
    wheels=(gpu_carry/wheels/*.whl)
    if [ -e "${wheels[0]}" ]; then
      site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
      t0=$SECONDS
      if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$site" "${wheels[@]}"; then
        echo "[gpu_check.sh] installed ${#wheels[@]} wheels into $site in $((SECONDS - t0)) s"
      else
        echo "[gpu_check.sh] WARNING: installing the carried wheels failed"
      fi
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
      export PATH="$site/bin:$PATH"
    else
      echo "[gpu_check.sh] WARNING: no gpu_carry/wheels/*.whl: run scripts/make_wheelhouse.sh" \
        "here and carry gpu_carry (using whatever this machine has)"
    fi
    [ "${DS_ACCELERATOR:-}" = cpu ] && unset DS_ACCELERATOR
  else
    export DS_ACCELERATOR=cpu
  fi
  export PYTHONUNBUFFERED=1
  limit=(timeout --kill-after=10 "$hard_limit")
  # the dry run (CPU, CI) has no clock: fixed work, every step to its end (unless the limit is set)
  [ "$dry" = 1 ] && [ -z "${GPU_CHECK_HARD_LIMIT_S:-}" ] && limit=()
  "${limit[@]}" "$py" scripts/gpu_check.py "$out" "$@"
  rc=$?
  [ $rc = 124 ] && echo "[gpu_check.sh] gpu_check.py passed the ${hard_limit} s hard limit"
  echo "[gpu_check.sh] exit $rc; results in $out"
  exit $rc
} 2>&1 | tee -a "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
