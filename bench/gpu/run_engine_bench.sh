#!/usr/bin/env bash
# `histospec-sgl bench engine` on the GPU box (FlashInfer tree attention, CUDA graphs, the real
# sgl-kernel verify and sampling kernels): the same table the CPU engine gives in bench/RESULTS.md.
# Run separately from run_on_box.sh (which uses most of a 10-minute run), with the same payload:
#   OUT=gpu-out bash bench/gpu/run_engine_bench.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
S=$(mktemp -d)
exec > >(tee "$OUT/engine-run.log") 2>&1
mkdir -p "$S/site" && tar -C "$S/site" -xJf .devpayload/sglang-site312.tar.xz || { echo "payload unpack failed"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target "$S/site" .devpayload/histospec_sgl-*.whl || exit 1
export PYTHONPATH="$S/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       TVM_FFI_CACHE_DIR="$S/jit/tvm-ffi" FLASHINFER_WORKSPACE_BASE="$S/jit" TOKENIZERS_PARALLELISM=false \
       SGLANG_JIT_CACHE_DIR="$S/jit/sglang" HISTOSPEC_MODEL_CACHE="$S/models"
if [ -f .devpayload/jitcache.tar.xz ]; then mkdir -p "$S/jit" && tar -C "$S/jit" -xJf .devpayload/jitcache.tar.xz; fi
# The random-weight model (seconds to build); the rhyme model trains for minutes on CPU, so it is
# built here only when asked: MODEL=rhyme.
timeout 560 python3 -m histospec_sgl.cli bench engine --device cuda --model "${MODEL:-random}" \
  --methods plain,ngram,history --json "$OUT/engine.json" --log-dir "$OUT/engine-logs" ${ENGINE_ARGS:-}
