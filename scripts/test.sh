#!/usr/bin/env bash
# The test command: sets up .venv, the system packages for the SLURM/MPI tests (when root),
# then runs ruff and the whole pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
  echo "[test.sh] installing slurm-wlm, munge, openmpi (one apt step, before any daemon starts)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    slurm-wlm munge openmpi-bin libopenmpi-dev >/dev/null
fi
. .venv/bin/activate
export DS_ACCELERATOR=cpu
# as root (CI) the SLURM/MPI tests must run: a missing cluster is a failure, not a skip
if [ "$(id -u)" = 0 ]; then export LINFORMER_DS_REQUIRE_SLURM=1; fi
ruff check .
python -m pytest -q "$@"
