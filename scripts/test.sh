#!/usr/bin/env bash
# Every test: Rust (unit + property tests) then Python (binding surface, errors, threads, the draft
# server, the SGLang plugin against a real SGLang install in .venv-sglang).
# Ends with pytest's summary line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# The binding crate (histospec-py) is glue with no Rust tests; it is exercised from Python.
RUST_TESTS=(--workspace --exclude histospec-py)
# The Rust tests compile while the SGLang environment downloads (its set-up is mostly waiting on the
# network on a fresh machine); their run below reports any build error.
mkdir -p target
cargo test "${RUST_TESTS[@]}" --no-run >target/test-build.log 2>&1 &
BUILD=$!
trap 'kill "$BUILD" 2>/dev/null || true' EXIT
# Real SGLang 0.5.17 (CPU) for the plugin tests; they fail rather than skip when it is missing.
bash scripts/setup_sglang_env.sh
wait "$BUILD" || true
export HISTOSPEC_REQUIRE_SGLANG=1
echo "[test] Rust"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run "${RUST_TESTS[@]}" --no-fail-fast
else
  cargo test "${RUST_TESTS[@]}"
fi
echo "[test] lint: ruff, mypy, stubtest"
bash scripts/lint_python.sh
echo "[test] Python"
# Three workers on the two cores (a test often waits on a server it started, or on memory), a module
# (or class) whole on one, the longest modules first (tests/conftest.py); tests that start servers
# wait for memory the other workers hold (tests/helpers/_lanes.py).
# The 25 slowest tests are listed before the summary, to see where the time goes.
.venv/bin/python -m pytest tests -n 3 --dist loadscope --no-loadscope-reorder --record-durations --durations=25 "$@"
