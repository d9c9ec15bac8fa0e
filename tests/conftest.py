"""Shared fixtures: the SGLang test environment (.venv-sglang, made by scripts/setup_sglang_env.sh)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
#: SGLang 0.5.23 unpacked beside 0.5.17 by scripts/setup_sglang_env.sh, laid over it on PYTHONPATH.
SGLANG_0523 = ROOT / ".venv-sglang" / "sglang-0.5.23"


def sglang_missing(fail: str, skip: str) -> NoReturn:
    """Where scripts/test.sh set up SGLang (HISTOSPEC_REQUIRE_SGLANG=1), a missing piece fails the
    test; elsewhere it skips it, saying why."""
    if os.environ.get("HISTOSPEC_REQUIRE_SGLANG") == "1":
        pytest.fail(fail)
    pytest.skip(skip)


@pytest.fixture(scope="module")
def sglang_py() -> Path:
    if not SGLANG_PY.exists():
        sglang_missing(".venv-sglang is missing: scripts/setup_sglang_env.sh did not run",
                       "needs .venv-sglang (real SGLang 0.5.17; bash scripts/setup_sglang_env.sh)")
    return SGLANG_PY


@pytest.fixture(scope="module")
def sglang_0523(sglang_py: Path) -> Path:
    if not (SGLANG_0523 / ".done").exists():
        sglang_missing(f"{SGLANG_0523} is missing: scripts/setup_sglang_env.sh did not finish",
                       "needs SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh")
    return SGLANG_0523


def build_model(py: Path, kind: str, **params) -> Path:
    """A local test model (histospec_sgl.bench.engine_models, built once and cached), by ``py``."""
    code = ("import json, sys; from histospec_sgl.bench.engine_models import ensure; "
            "print(ensure(sys.argv[1], log=lambda m: None, **json.loads(sys.argv[2])))")
    r = subprocess.run([str(py), "-c", code, kind, json.dumps(params)], capture_output=True, text=True,
                       timeout=900, cwd=str(ROOT / "tests"))
    if r.returncode:
        sglang_missing(f"building the {kind} model failed:\n{r.stderr[-3000:]}", "no torch/transformers")
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def greedy_model(sglang_py: Path) -> Path:
    """Random weights, float32: greedy continuations are deterministic, so every method must agree."""
    return build_model(sglang_py, "random")
