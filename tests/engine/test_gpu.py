"""HISTORY end to end on a CUDA GPU with a real SGLang server: ``bench/gpu/e2e.py``, the job the GPU box
runs first (through ``bench/gpu/run_on_box.sh``, which sets up SGLang 0.5.17 without network), run from
pytest where ``torch.cuda`` sees a GPU and SGLang is importable, and skipped otherwise, saying so. The
job's ``E2E PASS`` (its ``failed_checks``, tested here on CPU) stands for: greedy outputs under the
overlap scheduler (staggered arrivals, chunked prefill, radix hits, aborts, stop tokens, retraction)
token-identical to plain decoding's for HISTORY at a fixed width and on the default step policy, with
no context mismatch; 64 prompts x 128 tokens, twice, identical to plain decoding; more than one token
per verify step on the second pass; and sampling through SGLang's verify kernel distributed as plain
decoding's (a chi-square over the first 2, 3 and 4 tokens), with no context mismatch there either. The
same script runs on this project's CPU engine as a dry run (bench/gpu/NOTES.md).
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
    assert not res["failed"], res["failed"]
    assert res["pass"] and r.returncode == 0


def _job():
    spec = importlib.util.spec_from_file_location("gpu_e2e", ROOT / "bench" / "gpu" / "e2e.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_job_names_each_check_that_fails():
    """The job's pass on CPU, over e2e.json's keys as the job writes them: a passing result names no
    check, and each way a result can fail is named (the one GPU call must say why it failed)."""
    failed_checks = _job().failed_checks

    def passing() -> dict:
        ok = {"identical": True, "mismatches": [[], []], "context_mismatches": 0.0}
        return {"identity": {"history": dict(ok), "cost": dict(ok), "retract": {**ok, "retracted": 12.0},
                             "ngram": {"identical": False, "mismatches": [["r3"], []]}},
                "identical_64": {"plain": 0, "ngram": 3, "history": 0, "cost": 0},
                "accept_length": {"plain": 1.0, "ngram": 2.1, "history": 4.2, "cost": 3.9},
                "chi_square": {"p_values": [0.41, 0.08, 0.3], "context_mismatches": 0.0}}

    assert failed_checks(passing()) == []  # NGRAM, the comparison, differs and fails nothing
    breaks = {"identity cost: outputs differ": lambda r: r["identity"]["cost"].update(identical=False,
                                                                                      mismatches=[["r1"], []]),
              "identity retract: 2 context mismatches": lambda r: r["identity"]["retract"].update(
                  context_mismatches=2.0),
              "identical_64 history: 1 of 128": lambda r: r["identical_64"].update(history=1),
              "accept_length history: 1.000": lambda r: r["accept_length"].update(history=1.0),
              "chi_square: p-values": lambda r: r["chi_square"].update(p_values=[0.2, 1e-5, 0.3]),
              "chi_square: 1 context mismatches": lambda r: r["chi_square"].update(context_mismatches=1.0)}
    for said, brk in breaks.items():
        res = passing()
        brk(res)
        got = failed_checks(res)
        assert len(got) == 1 and got[0].startswith(said), (said, got)
