#!/usr/bin/env bash
# The GPU job: HISTORY end to end on a GPU machine. Run it from the repository root of a copy of
# the checkout that carries .devpayload (scripts/gpu_payload.sh builds it; the machine needs no
# network and no Rust), as one call of at most 10 minutes (bench/gpu/NOTES.md: what runs first):
#   OUT=gpu-out bash bench/gpu/run_on_box.sh
# Writes everything under $OUT: environment facts, kernel check, server logs, e2e.json (and
# e2e.partial.json after each phase).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
# A fixed directory, not mktemp: SGLang's JIT kernels (tvm-ffi) record the site's path in their
# build.ninja, so a cache built under one temp dir is rebuilt under another. Each call renews the
# site (pip --target keeps a package it finds there) and the logs; a warm machine's JIT cache stays.
S="${GPU_WORKDIR:-/tmp/histospec-gpu}"; rm -rf "$S/site" "$S/logs"; mkdir -p "$S"
ROOT="$PWD"
exec > >(tee "$OUT/run.log") 2>&1
echo "== box"; nvidia-smi -L; python3 --version; which nvcc ninja xz || true; ldd --version | head -1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
echo "== payload"; t0=$(date +%s)
mkdir -p "$S/site" && tar -C "$S/site" -xJf "$ROOT/.devpayload/sglang-site312.tar.xz" || { echo "payload unpack failed"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target "$S/site" "$ROOT"/.devpayload/histospec_sgl-*.whl || { echo "wheel install failed"; exit 1; }
# Everything below runs outside the checkout: its histospec_sgl (no compiled core) would shadow the wheel.
cd "$S"
echo "unpacked in $(( $(date +%s) - t0 )) s"
export PYTHONPATH="$S/site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       TVM_FFI_CACHE_DIR="$S/jit/tvm-ffi" FLASHINFER_WORKSPACE_BASE="$S/jit" TOKENIZERS_PARALLELISM=false \
       SGLANG_JIT_CACHE_DIR="$S/jit/sglang" HISTOSPEC_LOG_EVERY=50 HISTOSPEC_MODEL_CACHE="$S/models"
if [ -f "$ROOT/.devpayload/jitcache.tar.xz" ]; then mkdir -p "$S/jit" && tar -C "$S/jit" -xJf "$ROOT/.devpayload/jitcache.tar.xz"; fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
echo "== kernel check (gpu-box.md section 9.1)"
python3 -c "import torch, sgl_kernel; print(torch.__version__, torch.ops.sgl_kernel.verify_tree_greedy)" || echo "sgl_kernel FAILED"
python3 -m histospec_sgl.cli launch-server --check || echo "plugin check FAILED"
echo "== tiny model"
python3 "$ROOT/.devpayload/make_tiny_model.py" "$S/tiny" || { echo "tiny model failed"; exit 1; }
echo "== e2e"
# E2E_TIMEOUT has to end the checks about 40 s before the call's own limit (the steps above take
# 30-35 s), or the call is killed before the logs are packed below.
timeout "${E2E_TIMEOUT:-520}" python3 "$ROOT/bench/gpu/e2e.py" --model "$S/tiny" --out "$OUT" --log-dir "$S/logs" \
  ${E2E_ARGS:-}
rc=$?
# One archive for the servers' logs: a call returns at most 8 files.
tar -C "$S/logs" -cJf "$OUT/server-logs.tar.xz" . 2>/dev/null
# The index's threads on the box's cores (no GPU needed): WORKER_THREADS="1 4 8" runs bench worker once
# per count, each under WORKER_TIMEOUT seconds, after the e2e check so that it never eats its time.
for t in ${WORKER_THREADS:-}; do
  echo "== bench worker --threads $t"
  OPENBLAS_NUM_THREADS=1 timeout "${WORKER_TIMEOUT:-45}" python3 -m histospec_sgl.cli bench worker --threads "$t" \
    --json "$OUT/worker-t$t.json" || echo "bench worker --threads $t did not finish"
done
echo "== jit cache"; tar -C "$S/jit" -cJf "$OUT/jitcache.tar.xz" . 2>/dev/null; ls -la "$OUT"
exit $rc
