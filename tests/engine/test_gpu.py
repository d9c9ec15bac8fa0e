"""End-to-end checks that need a CUDA GPU and a real SGLang server (the plugin, SPEC-RL scoring).

On the GPU box they run through ``bench/gpu/run_on_box.sh`` (which sets up SGLang 0.5.17 without
network); here they run only where ``torch.cuda`` sees a GPU and SGLang is importable, and skip
otherwise, saying so. What they check: greedy outputs with ``--speculative-algorithm HISTORY``
token-identical to plain decoding on 64 prompts, more than one token per verify step on a second
pass, and the SPEC-RL scoring alignment (``input_token_logprobs`` from ``logprob_start_len``) on a real
server.
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
    assert res["identical"], f"{res['mismatches']} prompts differ from plain greedy decoding"
    assert res["history"]["pass2_accept_length"] > 1.0
    assert res["specrl_alignment"]["max_abs_logprob_diff"] < 1e-2
    assert r.returncode == 0
