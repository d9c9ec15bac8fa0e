#!/usr/bin/env bash
# One command on a fresh machine: build, install into .venv, run the main job and print its result.
# Until the offline replay lands, the main job is the index benchmark (W1/W2, one thread).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# One thread for the measurement: keep numpy's BLAS pool from spinning on the second core.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
.venv/bin/histospec-sgl bench index --json bench/out/index.json "$@"
