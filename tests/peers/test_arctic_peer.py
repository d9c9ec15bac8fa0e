"""ArcticInference's SuffixDecoding as a peer (``histospec_sgl.replay.arctic``), driven for real.

arctic-inference 0.3.0 builds from its sdist against an installed torch, so it lives in
``.venv-sglang`` (``scripts/setup_sglang_env.sh`` installs it). These tests run there in
subprocesses; ``scripts/test.sh`` sets ``HISTOSPEC_REQUIRE_SGLANG=1``, so there they fail instead of
skipping when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-sglang" / "bin" / "python"


@pytest.fixture(scope="module")
def arctic_py() -> Path:
    why = None
    if not PY.exists():
        why = ".venv-sglang is missing (bash scripts/setup_sglang_env.sh)"
    else:
        r = subprocess.run([str(PY), "-c", "from histospec_sgl.replay import arctic; print(arctic.missing_reason())"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or r.stdout.strip() != "None":
            why = f"arctic-inference does not import in .venv-sglang: {(r.stdout + r.stderr)[-500:]}"
    if why:
        if os.environ.get("HISTOSPEC_REQUIRE_SGLANG") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return PY


def _run(py: Path, code: str, timeout: int = 300) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")},
           "PYTHONWARNINGS": "ignore", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([str(py), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=str(ROOT / "tests"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_TINY = r"""
import json, sys, tempfile
from pathlib import Path
from histospec_sgl.replay import FieldMap, Selection, build_cases, load_rollouts
from histospec_sgl.replay.arctic import per_prompt_method, shared_cache_method
from histospec_sgl.replay.measure import run_method

ids = FieldMap("p", "r", group="g", token_ids=True)
def log(rows):
    f = Path(tempfile.mkdtemp()) / "log.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_rollouts(f, ids)

tiny = log([{"g": "q", "p": [1, 2], "r": [3, 4, 5, 9, 6, 7]}, {"g": "q", "p": [1, 2], "r": [3, 4, 5, 6, 8]}])
same = log([{"g": "q", "p": [1], "r": [2, 3, 4, 5, 6, 7, 8, 9]}] * 2
           + [{"g": "q", "p": [1], "r": [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}])
out = {}
for name, m in (("per_prompt", per_prompt_method()), ("global", shared_cache_method())):
    t = run_method(m, build_cases(tiny, "cross-sample", Selection(per_group=0)), 16)
    out[name] = [t.emitted, t.steps, t.covered, t.accepted, t.hist[:3]]
    t = run_method(m, build_cases(same, "cross-sample-inflight", Selection(per_group=1)), 16)
    out[name + "_inflight"] = [t.emitted, t.steps]
    t = run_method(m, build_cases(same, "cross-sample", Selection(per_group=1)), 16)
    out[name + "_finished"] = [t.emitted, t.steps]

# Per-prompt trees: a sibling's output in flight, then kept, then dropped.
from histospec_sgl.replay.arctic import BEST, PerPromptTrees
def drafts(keep):
    t = PerPromptTrees()
    a, b = t.begin([1, 2]), t.begin([1, 2])
    t.extend(a, [5, 6, 7, 8])
    t.extend(b, [5])
    got = [list(t.speculate(b, [1, 2, 5], 15, BEST).token_ids)]
    t.finish(a, keep=keep)
    got.append(list(t.speculate(b, [1, 2, 5], 15, BEST).token_ids))
    return got
out["live"] = drafts(True) + drafts(False)[1:]
print(json.dumps(out))
"""


def test_arctic_replay_methods_hand_computed(arctic_py):
    """The tiny log of tests/unit/test_replay.py, replayed with Arctic's real trees.

    Per prompt (factor 4, tree): A over B: prefill 3; "2 3" matches B, draft 4 5 6 8 (budget
    2 x 4), accept 4 5, emit 4 5 9; "9" only ends A's own sequence: empty, emit 6; "6" -> 8, emit 7.
    B over A: draft 4 5 9 6 7, accept 4 5, emit 4 5 6; "6" -> 7, emit 8. 9 tokens, 5 steps, 4 with
    a draft, accepted 2 0 0 and 2 0.

    The shipped cache (factor 1, chains): its global tree holds responses without their prompts, so
    after the prefill only "3" matches (1 token: a 1-token draft). A over B: 4, accept, emit 4 5;
    "3 4 5" -> 6 8 (the longer match wins the tie), emit 9; "9": nothing, emit 6; "6" -> 8, emit 7.
    B over A: 4, emit 4 5; "3 4 5" -> 9 6 7, emit 6; "6" -> 7, emit 8. 9 tokens, 7 steps, 6 with a
    draft, accepted 1 0 0 0 and 1 0 0.

    Siblings in flight that are exactly as far as the replayed sample give nothing to copy (no
    draft from the future); finished ones give it all. In the per-prompt trees a sibling's output
    is drafted from while it is in flight (the live tree), after it finishes kept (history), and
    not after it is dropped."""
    out = _run(arctic_py, _TINY)
    assert out["per_prompt"] == [9, 5, 4, 4, [3, 0, 2]], out["per_prompt"]
    assert out["global"] == [9, 7, 6, 2, [5, 2, 0]], out["global"]
    for name in ("per_prompt", "global"):
        emitted, steps = out[name + "_inflight"]
        assert emitted == steps, (name, out[name + "_inflight"])
        emitted, steps = out[name + "_finished"]
        assert emitted > 2 * steps, (name, out[name + "_finished"])
    assert out["live"] == [[6, 7, 8], [6, 7, 8], []], out["live"]


_BENCH = r"""
import json
from histospec_sgl.bench import index_bench
from histospec_sgl.bench.index_peers import ArcticPeer
from histospec_sgl.bench.workload import W1, generate
w = generate(W1, prompts=4)
out = {}
for per_prompt in (True, False):
    index_bench._release()
    peer = ArcticPeer(per_prompt)
    out[peer.name] = peer.run(w, index_bench._rss, steps=3, acc_prompts=2, latency_requests=4)
out["ours"] = index_bench.acceptance(w, 2)
print(json.dumps(out))
"""


def test_index_bench_runs_arctic_suffix_decoding(arctic_py):
    """``bench index``'s Arctic peers on a 4-prompt W1: both ingest, draft and update, and their
    acceptance is in the range anchors.md measured for Arctic (k=16 about 9-10 per position), below
    ours on the same responses."""
    out = _run(arctic_py, _BENCH)
    ours = out.pop("ours")
    assert set(out) == {"arctic-per-prompt", "arctic-global"}
    for name, r in out.items():
        for k in ("ingest_tokens_per_s", "bytes_per_token", "batch_draft_ms_per_step", "update_ms_per_step"):
            assert r[k] > 0, (name, k, r[k])
        assert 6.0 < r["accepted_per_position_k16"] < ours["accepted_per_position_k16"], (name, r, ours)
        assert 3.0 < r["tokens_per_verify_step_d16"] < ours["tokens_per_verify_step_d16"], (name, r, ours)


def test_replay_cli_runs_arctic_peers_by_default_where_installed(arctic_py, tmp_path):
    """``histospec-sgl replay`` without ``--peers``, where arctic-inference is installed: the default
    peers and both Arctic ones run (status ok) and draft for most steps; ``--peers`` still narrows."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}, "OPENBLAS_NUM_THREADS": "1"}

    def replay(*extra: str) -> dict:
        out = tmp_path / "r.json"
        r = subprocess.run([str(arctic_py), "-m", "histospec_sgl.cli", "replay", "--preset", "humaneval-sample",
                            "--scenario", "cross-sample", "--no-progress", "--json", str(out), *extra],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())["peers"]

    peers = replay()
    for name in ("ngram", "sglang_trie_per_prompt", "sglang_trie_global", "arctic_per_prompt", "arctic_global"):
        assert peers[name]["status"] == "ok", (name, peers[name])
    for name in ("arctic_per_prompt", "arctic_global"):
        assert peers[name]["tokens_per_verify_step"] > 1.5 and peers[name]["draft_coverage"] > 0.5, peers[name]
    peers = replay("--peers", "ngram")
    assert peers["ngram"]["status"] == "ok" and peers["arctic_global"]["status"] == "missing"
    assert "not requested" in peers["arctic_global"]["reason"]
