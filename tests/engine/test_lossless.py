"""HISTORY is lossless under SGLang's own overlap scheduler, the one every GPU user runs, for every
request SGLang accepts: real ``sglang.launch_server`` processes on the CPU engine (bench/cpu_engine
keeps the overlap scheduler on for speculation, which SGLang itself turns off on a CPU), greedy
outputs compared token by token with a plain-decoding server's.

Each HISTORY server runs with ``HISTOSPEC_CHECK_CONTEXT=1``: at every decode step each request's
context in the index must be what SGLang holds (its processed output tokens, then the relayed ones
not processed yet, adding up with ``seq_lens``), and ``histospec:context_mismatches_total`` must stay 0.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _engine_checks import FIXED, greedy_passes, random_prompts, server
from _overlap import mismatches, requests, run

from histospec_sgl.bench.engine_server import EngineServer, verify_steps, width_steps

#: Each test starts one to three SGLang servers (15-30 s each on two cores).
pytestmark = pytest.mark.timeout(900)
#: Chunked prefill small enough that the scenario's long prompt (300 tokens) is prefilled in chunks,
#: hidden states and custom logit processors allowed (requests ask for them).
EXTRA = ["--chunked-prefill-size", "64", "--enable-return-hidden-states", "--enable-custom-logit-processor"]
CHECKED = {"HISTOSPEC_CHECK_CONTEXT": "1"}


def _counter(srv: EngineServer, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in srv.metrics().splitlines() if line.startswith(name + "{"))


def _history(py: Path, model: Path, tmp: Path, tag: str, env: dict[str, str]) -> EngineServer:
    """A HISTORY server on the engine's default step policy unless ``env`` names one (:data:`FIXED`)."""
    return server(py, model, "history", tmp, max_running=16, tag=tag,
                  env={**CHECKED, **env}, extra=[*EXTRA, "--enable-metrics"])


@pytest.fixture(scope="module")
def plain(sglang_py, greedy_model, tmp_path_factory):
    with server(sglang_py, greedy_model, "plain", tmp_path_factory.mktemp("plain"), max_running=16,
                extra=EXTRA) as srv:
        yield srv


@pytest.fixture(scope="module")
def default(sglang_py, greedy_model, tmp_path_factory):
    """A HISTORY server on the default step policy, shared by the module's last two tests (the
    every-request checks, then the scenario): one server start fewer."""
    with _history(sglang_py, greedy_model, tmp_path_factory.mktemp("default"), "default", {}) as srv:
        yield srv


def _check_scenario(srv: EngineServer, plain: EngineServer, passes: int = 2) -> list[dict]:
    """The scenario (tests/helpers/_overlap.py) ``passes`` times (a later pass drafts from the earlier
    ones' history): every response equal to plain decoding's, no context mismatch. Returns each pass's
    result."""
    out = []
    for p in range(passes):
        res = run(srv, plain)
        assert mismatches(res) == [], f"pass {p + 1}: {mismatches(res)}"
        out.append(res)
    assert _counter(srv, "histospec:context_mismatches_total") == 0
    assert srv.overlap(), "the server runs SGLang's overlap scheduler"
    assert "Traceback" not in srv.log_tail(10 ** 7)
    return out


def _ran_since(srv: EngineServer, before: dict[str, int]) -> set[str]:
    """The verify widths ``srv`` ran steps at since its :func:`width_steps` read ``before``."""
    return {w for w, n in (width_steps(srv) or {}).items() if n > before.get(w, 0)}


def _tokens_per_step(res: dict) -> float:
    outs = [o for r, o in zip(res["reqs"], res["got"].values()) if "abort_after" not in r]
    return sum(len(o["output_ids"]) for o in outs) / sum(verify_steps(o) for o in outs)


@pytest.mark.memory(4.5)
def test_history_under_the_overlap_scheduler_on_sglang_0_5_23(sglang_py, sglang_0523, greedy_model, plain,
                                                             tmp_path):
    """The scenario of the last test on SGLang 0.5.23 (laid over the 0.5.17 environment), default step
    policy with test retraction: every response equals plain decoding's (0.5.17's), no context mismatch. Then
    greedy passes at batch 1 and 8 with each token's log-prob, as a trainer asks for them: tokens and
    log-probs equal plain decoding's, and the pass after ``flush_cache`` (a weight update) still
    drafts from the history kept."""
    env = {"PYTHONPATH": str(sglang_0523), "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
           "SGLANG_TEST_RETRACT": "1"}
    prompts = random_prompts(8, seed=1)
    with _history(sglang_py, greedy_model, tmp_path, "0.5.23", env) as srv:
        passes = _check_scenario(srv, plain)
        assert _counter(srv, "sglang:num_retracted_requests_total") > 0
        assert _tokens_per_step(passes[1]) > 2.0
        with urllib.request.urlopen(srv.url + "/server_info", timeout=30) as r:
            assert json.loads(r.read())["version"] == "0.5.23"
        want = greedy_passes(plain, prompts, passes=1)[0]
        got = greedy_passes(srv, prompts)
        assert _counter(srv, "histospec:context_mismatches_total") == 0
    for i, p in enumerate(got):
        assert p["outputs"] == want["outputs"], f"pass {i + 1}"
        assert np.abs(np.concatenate(p["logprobs"]) - np.concatenate(want["logprobs"])).max() < 1e-4, i
    # Pass 3 follows flush_cache: the history of passes 1 and 2 drafts it (the default policy may
    # verify narrower than d, so fewer than d tokens a step).
    assert got[2]["tokens"] / got[2]["steps"] > 2.0, got[2]


def _disallowed_tokens_processor(py: Path) -> str:
    """SGLang's own custom logit processor that bans the tokens a request names, serialized as a
    client sends it."""
    code = ("from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor as P; "
            "print(P().to_str())")
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.memory(5)
def test_every_request_and_every_step_returns_what_plain_decoding_returns(sglang_py, plain, default):
    """On the default step policy, whichever way a step ran (plain, a narrower verify, width d):
    ``--enable-return-hidden-states`` and top-k log-probs return plain decoding's rows, one per token.
    And requests whose sampling SGLang's verify path does not reproduce (penalties, a custom logit
    processor) are decoded plainly on every step, with plain decoding's tokens, while ``logit_bias``,
    which both paths apply alike, is drafted and verified."""
    import random

    rng = random.Random(5)
    prompts = [[rng.randrange(2, 510) for _ in range(rng.randrange(12, 40))] for _ in range(8)]
    sp = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    srv = default
    before = width_steps(srv) or {}
    for p in range(8):
        if p >= 3:
            # The policy picks widths by the step costs it measures on this noisy machine: until it
            # has run a narrower width, fresh prompts (short matches, moderate promises) give it
            # more chances to.
            if _ran_since(srv, before) & {"2", "4"}:
                break
            prompts = [[rng.randrange(2, 510) for _ in range(rng.randrange(12, 40))] for _ in range(8)]
        got = srv.generate(prompts, sp, return_logprob=True, top_logprobs_num=3, return_hidden_states=True)
        want = plain.generate(prompts, sp, return_logprob=True, top_logprobs_num=3, return_hidden_states=True)
        for o, w in zip(got, want):
            assert o["output_ids"] == w["output_ids"], p
            hs, hw = o["meta_info"]["hidden_states"], w["meta_info"]["hidden_states"]
            assert len(hs) == len(hw) == 32
            worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(hs, hw))
            assert worst < 1e-3, (p, worst)
            top = [[t[1] for t in row] for row in o["meta_info"]["output_top_logprobs"]]
            assert top == [[t[1] for t in row] for row in w["meta_info"]["output_top_logprobs"]], p
    ran = _ran_since(srv, before)
    # plain steps, width d, and a narrower verify width in between
    assert {"1", "8"} <= ran and ran & {"2", "4"}, (ran, width_steps(srv))
    # Sampling parameters, greedy (deterministic): each after a pass without them, so that the
    # history drafts what the unpenalized policy says.
    processor = _disallowed_tokens_processor(sglang_py)
    banned = sorted({o["output_ids"][3] for o in plain.generate(prompts, sp)})
    cases = {"repetition_penalty": {"repetition_penalty": 1.3}, "frequency_penalty": {"frequency_penalty": 0.8},
             "presence_penalty": {"presence_penalty": 0.8}, "logit_bias": {"logit_bias": {str(banned[0]): 4.0}},
             "custom logit processor": {"custom_params": {"token_ids": banned}}}
    for name, extra in cases.items():
        params = {**sp, **extra}
        kw = {"custom_logit_processor": processor} if "custom_params" in extra else {}
        want = [o["output_ids"] for o in plain.generate(prompts, params, **kw)]
        out = srv.generate(prompts, params, **kw)
        assert [o["output_ids"] for o in out] == want, name
        if name == "logit_bias":
            # Once more: the biased pass's own history drafts it (the unbiased one's drafts diverge
            # where the bias changes a token, and how far that leaves acceptance is up to the model).
            out = srv.generate(prompts, params, **kw)
            assert [o["output_ids"] for o in out] == want, name
        # Decode steps (SGLang's spec_verify_ct, plain ones included) against tokens past the
        # prefill's: one each where every step is plain.
        steps = sum(verify_steps(o) for o in out)
        decoded = sum(len(o["output_ids"]) - 1 for o in out)
        if name == "logit_bias":
            assert decoded > 2 * steps, "logit_bias is verified: drafts are accepted"
        else:
            assert decoded == steps, f"{name}: every step plain"
        assert any(w != o["output_ids"] for w, o in zip(want, plain.generate(prompts, sp))), \
            f"{name} changes the outputs (else this checks nothing)"
    assert _counter(srv, "histospec:context_mismatches_total") == 0


@pytest.mark.memory(6.5)
def test_history_under_the_overlap_scheduler_equals_plain_decoding(sglang_py, greedy_model, plain, default, tmp_path):
    """Greedy requests arriving while others decode, a long prompt prefilled in chunks, radix-cache
    hits, aborts mid-decode and early stops at a stop token, twice over (the second pass drafts from
    the first's history), under the default step policy and at a fixed width with SGLang's test
    retraction (``SGLANG_TEST_RETRACT``: requests retracted and re-prefilled every few steps): every
    response equals plain decoding's, and no request's context ever disagrees with SGLang's.

    Taking every relayed token as missing from ``output_ids`` (the rule that gave different tokens on
    a GPU, broken on purpose through ``CPU_ENGINE_BROKEN_FILE``) shows here as context mismatches."""
    switch = tmp_path / "broken"
    before = width_steps(default) or {}
    with _history(sglang_py, greedy_model, tmp_path, "retract",
                  {**FIXED, "SGLANG_TEST_RETRACT": "1", "CPU_ENGINE_BROKEN_FILE": str(switch)}) as retract:
        passes = _check_scenario(default, plain)
        assert {"1", "8"} <= _ran_since(default, before), (before, width_steps(default))
        assert _tokens_per_step(passes[1]) > 2.0
        passes = _check_scenario(retract, plain)
        assert _counter(retract, "sglang:num_retracted_requests_total") > 0
        assert _tokens_per_step(passes[1]) > 2.0
        switch.write_text("relay")
        res = run(retract, plain, requests(seed=1))
        switch.write_text("")
        assert _counter(retract, "histospec:context_mismatches_total") > 0
    assert all(len(o["output_ids"]) for o in res["got"].values())
