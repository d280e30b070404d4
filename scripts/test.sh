#!/usr/bin/env bash
# The test command: sets up .venv, the system packages for the SLURM/MPI tests (when root),
# then runs ruff and the whole pytest suite (CI runs exactly this).
#   bash scripts/test.sh [pytest args]            the full suite
#   bash scripts/test.sh --quick [pytest args]    the quick tier: -m "not slow" (no multi-rank,
#                                                 SLURM or whole-tool runs; tests/conftest.py)
#   LINFORMER_DS_TEST_WORKERS=0 bash scripts/test.sh   in one process (default: 2 workers)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = --quick ]; then quick=1; shift; fi
bash scripts/setup_env.sh
if [ "$quick" = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! command -v slurmctld >/dev/null; then
  echo "[test.sh] installing slurm-wlm, munge, openmpi (one apt step, before any daemon starts)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    slurm-wlm munge openmpi-bin libopenmpi-dev >/dev/null
fi
. .venv/bin/activate
export DS_ACCELERATOR=cpu
# as root (CI) the SLURM/MPI tests must run: a missing cluster is a failure, not a skip
if [ "$(id -u)" = 0 ]; then export LINFORMER_DS_REQUIRE_SLURM=1; fi
ruff check .
ruff format --check .  # Markdown excluded (pyproject): code blocks there are as measured
# two workers (pytest-xdist; LINFORMER_DS_TEST_WORKERS, 0: one process): a test module runs
# whole on one worker (tests/conftest.py groups them); most tests run one torch thread, so a
# second worker uses the core that one leaves idle
workers=(-n "${LINFORMER_DS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
if [ "${LINFORMER_DS_TEST_WORKERS:-2}" = 0 ]; then workers=(-p no:xdist); fi
if [ "$quick" = 1 ]; then
  python -m pytest -q "${workers[@]}" -m "not slow and not gpu" "$@"
else
  python -m pytest -q "${workers[@]}" --durations=30 "$@"
fi
