#!/usr/bin/env bash
# Builds .devpayload/ for the GPU box (git-ignored; carried with `run(carry=[".devpayload"])`):
# SGLang 0.5.17's pre-installed site tree for the box's cp312 / torch 2.11 (the shared recipe,
# ../shared/device), the tiny-model script, and this checkout's abi3 wheel (the box has no Rust).
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
du -sh .devpayload/*
