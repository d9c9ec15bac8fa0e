#!/usr/bin/env bash
# `histospec-sgl bench engine` on the GPU box (FlashInfer tree attention, CUDA graphs, the real
# sgl-kernel verify and sampling kernels): the same table the CPU engine gives in bench/RESULTS.md,
# the default policy (history_cost: plain steps or widths 2, 4, 8) beside HISTORY fixed at d = 8 and,
# in a second run, at d = 4. Run separately from run_on_box.sh (which uses most of a 10-minute run),
# with the same payload:
#   OUT=gpu-out bash bench/gpu/run_engine_bench.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
S=$(mktemp -d)
ROOT="$PWD"
exec > >(tee "$OUT/engine-run.log") 2>&1
mkdir -p "$S/site" && tar -C "$S/site" -xJf "$ROOT/.devpayload/sglang-site312.tar.xz" || { echo "payload unpack failed"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target "$S/site" "$ROOT"/.devpayload/histospec_sgl-*.whl || exit 1
# Run outside the checkout: its histospec_sgl (no compiled core) would shadow the wheel.
cd "$S"
export PYTHONPATH="$S/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       TVM_FFI_CACHE_DIR="$S/jit/tvm-ffi" FLASHINFER_WORKSPACE_BASE="$S/jit" TOKENIZERS_PARALLELISM=false \
       SGLANG_JIT_CACHE_DIR="$S/jit/sglang" HISTOSPEC_MODEL_CACHE="$S/models" MAX_JOBS="$(nproc)"
if [ -f "$ROOT/.devpayload/jitcache.tar.xz" ]; then mkdir -p "$S/jit" && tar -C "$S/jit" -xJf "$ROOT/.devpayload/jitcache.tar.xz"; fi
# The random-weight model (seconds to build); the rhyme model trains for minutes on CPU, so it is
# built here only when asked: MODEL=rhyme.
timeout 400 python3 -m histospec_sgl.cli bench engine --device cuda --model "${MODEL:-random}" \
  --methods plain,ngram,history,history_cost --json "$OUT/engine.json" --log-dir "$OUT/engine-logs" ${ENGINE_ARGS:-}
timeout 150 python3 -m histospec_sgl.cli bench engine --device cuda --model "${MODEL:-random}" --draft-tokens 4 \
  --methods plain,history --json "$OUT/engine-d4.json" --log-dir "$OUT/engine-logs-d4" ${ENGINE_ARGS:-}
