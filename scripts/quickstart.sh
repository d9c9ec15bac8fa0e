#!/usr/bin/env bash
# One command on a fresh machine: build, install into .venv, run the main job and print its result.
# The main job is the offline replay on the shipped HumanEval sample (MIT, microsoft/CodeT): how many
# tokens per verify step history drafting gives on real completions, next to the peers. Extra
# arguments go to `histospec-sgl replay` (e.g. --preset grpo --scenario cross-sample-inflight).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
if [ "$#" -eq 0 ]; then
  set -- --preset humaneval-sample --scenario cross-sample
fi
.venv/bin/histospec-sgl replay "$@" --json bench/out/quickstart.json --plot bench/out/plots
