#!/usr/bin/env bash
# Python checks (scripts/test.sh runs them before the tests): ruff, mypy over the package, and
# mypy's stubtest of the hand-written stubs of the native module (histospec_sgl/_core.pyi) against
# the built extension. Needs .venv (scripts/setup_env.sh installs ruff and mypy with the test extra).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/ruff check histospec_sgl tests bench
.venv/bin/mypy
.venv/bin/python -m mypy.stubtest histospec_sgl._core
