#!/usr/bin/env bash
# Creates .venv at the repository root (if missing), then builds histospec-sgl (release) and
# installs it into it together with the benchmark and test extras. Idempotent; safe to re-run.
# Needs only what a clean machine has: the Rust toolchain, Python 3.11 and network access to PyPI
# and crates.io. No system packages. Packages install with uv (from PyPI, into .venv; several times
# faster than pip on two cores), which scripts/setup_sglang_env.sh uses too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# Byte-compiled at install, as pip does (uv does not by default): where PYTHONDONTWRITEBYTECODE is
# set, nothing would cache the compiled modules and every SGLang process would compile torch's again.
export UV_COMPILE_BYTECODE=1
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q "uv>=0.13,<0.14"
.venv/bin/uv pip install -q --python .venv/bin/python "maturin>=1.7,<2"
echo "[setup] building and installing histospec-sgl into .venv (release)"
VIRTUAL_ENV="$ROOT/.venv" PATH="$ROOT/.venv/bin:$PATH" \
  .venv/bin/maturin develop --release -q --uv --extras bench,test
