"""SGLang's own NGRAM code as a benchmark peer, in .venv-sglang: its C++ corpus in the replay, its
suffix automaton and its trie in ``bench index``."""

from __future__ import annotations

import json
import subprocess

import pytest
from sglang_subprocess import run_script, sglang_env


def test_replay_drives_sglangs_own_ngram_corpus(sglang_py, tmp_path):
    """The replay peer ``sglang_ngram_global`` runs SGLang's real C++ NGRAM corpus (JIT-built here):
    on the shipped HumanEval sample it must agree with our reimplementation of the same trie
    (``sglang_trie_global``), which the other benchmarks use where SGLang is not installed."""
    out = tmp_path / "r.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "replay", "--preset", "humaneval-sample",
                        "--scenario", "cross-sample", "--peers", "sglang_trie_global,sglang_ngram_global",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=sglang_env(PYTHONWARNINGS="ignore", OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    peers = json.loads(out.read_text())["peers"]
    real, model = peers["sglang_ngram_global"], peers["sglang_trie_global"]
    assert real["status"] == model["status"] == "ok"
    assert real["tokens_per_verify_step"] > 1.5
    assert abs(real["tokens_per_verify_step"] / model["tokens_per_verify_step"] - 1) < 0.05


def test_index_bench_runs_sglangs_own_suffix_automaton(sglang_py):
    """``bench index`` measures SGLang's real NGRAM suffix automaton (its external-corpus SAM, one per
    prompt) side by side with ours; on a 4-prompt W1 both must draft, at comparable acceptance."""
    r = run_script(sglang_py, "sglang_index_peer.py", "sam", env={"OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    peer, ours = res["peer"], res["ours"]
    assert peer["ingest_tokens_per_s"] > 0 and peer["batch_draft_ms_per_step"] > 0
    assert peer["accepted_per_position_k16"] > 3.0 and peer["tokens_per_verify_step_d16"] > 2.0
    for k in ("accepted_per_position_k16", "tokens_per_verify_step_d16"):
        assert 0.7 < peer[k] / ours[k] < 1.3, (k, peer[k], ours[k])


@pytest.mark.memory(3)
def test_index_bench_runs_sglangs_own_trie(sglang_py):
    """``bench index`` measures SGLang's real NGRAM trie (its online index): one corpus at its default
    capacity for ingest and the per-step calls, a corpus per prompt for acceptance. On a 4-prompt W1
    it drafts and accepts in the range anchors.md measured for it (k=16 about 7), below ours."""
    r = run_script(sglang_py, "sglang_index_peer.py", "trie", env={"OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    peer, ours = res["peer"], res["ours"]
    for k in ("ingest_tokens_per_s", "bytes_per_token", "batch_draft_ms_per_step", "update_ms_per_step"):
        assert peer[k] > 0, (k, peer[k])
    assert 5.0 < peer["accepted_per_position_k16"] < ours["accepted_per_position_k16"], (peer, ours)
    assert 3.0 < peer["tokens_per_verify_step_d16"] < ours["tokens_per_verify_step_d16"], (peer, ours)
