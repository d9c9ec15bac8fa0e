#!/usr/bin/env bash
# Creates .venv at the repository root (if missing), then builds histospec-sgl (release) and
# installs it into it together with the benchmark and test extras. Idempotent; safe to re-run.
# Needs only what a clean machine has: the Rust toolchain, Python 3.11 and network access to PyPI
# and crates.io. No system packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "maturin>=1.7,<2"
echo "[setup] building and installing histospec-sgl into .venv (release)"
VIRTUAL_ENV="$ROOT/.venv" PATH="$ROOT/.venv/bin:$PATH" \
  .venv/bin/maturin develop --release -q --extras bench,test
