"""HISTORY end to end on a CUDA GPU with a real SGLang server: ``bench/gpu/e2e.py``, the job the GPU box
runs first (through ``bench/gpu/run_on_box.sh``, which sets up SGLang 0.5.17 without network), run from
pytest where ``torch.cuda`` sees a GPU and SGLang is importable, and skipped otherwise, saying so. It
asserts what the job's ``E2E PASS`` stands for, key by key of its ``e2e.json``: greedy outputs under the
overlap scheduler (staggered arrivals, chunked prefill, radix hits, aborts, stop tokens, retraction)
token-identical to plain decoding's for HISTORY at a fixed width and on the default step policy, with
no context mismatch; 64 prompts x 128 tokens, twice, identical to plain decoding; more than one token
per verify step on the second pass; and sampling through SGLang's verify kernel distributed as plain
decoding's (a chi-square over the first 2, 3 and 4 tokens). The same script runs on this project's CPU
engine as a dry run (bench/gpu/NOTES.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_and_sglang() -> str | None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang") is None:
        return "needs torch and sglang in this interpreter (the GPU box runs bench/gpu/run_on_box.sh)"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible)"
    if not os.environ.get("HISTOSPEC_TINY_MODEL"):
        return "set HISTOSPEC_TINY_MODEL to a model directory (make_tiny_model.py builds one)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_and_sglang() is not None, reason=str(_gpu_and_sglang()))
def test_history_server_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "e2e.py"), "--model",
                        os.environ["HISTOSPEC_TINY_MODEL"], "--out", str(tmp_path)], timeout=1200)
    res = json.loads((tmp_path / "e2e.json").read_text())
    for name, check in res["identity"].items():
        if name == "ngram":  # SGLang's own, run for comparison
            continue
        assert check["identical"], f"{name}: outputs differ from plain greedy decoding: {check['mismatches']}"
        assert not check.get("context_mismatches"), f"{name}: {check['context_mismatches']} context mismatches"
    assert res["identical_64"]["history"] == 0 and res["identical_64"]["cost"] == 0, res["identical_64"]
    assert res["accept_length"]["history"] > 1.0
    assert min(res["chi_square"]["p_values"]) > 1e-4, res["chi_square"]
    assert res["pass"] and r.returncode == 0
