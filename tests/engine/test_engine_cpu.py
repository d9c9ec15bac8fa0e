"""A real model decoding through ``--speculative-algorithm HISTORY``: SGLang's own server and Engine
processes, scheduler, radix cache, memory pools, Llama model code, logits processor, sampler and NGRAM's
whole verify path, on this machine's CPU, with a small Llama built locally
(:mod:`histospec_sgl.bench.engine_models`).

What is stood in, in test support only (``bench/cpu_engine`` with its ``stubs``; see their
docstrings): tree attention for the verify forward of SGLang's ``torch_native`` backend, SGLang's
sampling-verify branch on CPU, and plain-torch restatements of the sgl-kernel ops SGLang calls there.
Each is shown load-bearing here: ``CPU_ENGINE_BROKEN_FILE`` breaks one for a while on a running server,
and the checks that pass without it fail with it.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _engine_checks import FIXED, greedy_passes, same_distribution, sample, server
from _scopes import other_scopes

from conftest import DRIVERS, ROOT
from histospec_sgl.bench.engine_server import EngineServer, cpu_engine_env, running, verify_steps

D = 8
#: Each test starts two to four SGLang servers (15-30 s each on two cores), side by side.
pytestmark = pytest.mark.timeout(900)


def _prompts(n: int, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(rng.randrange(12, 40))] for _ in range(n)]


@contextlib.contextmanager
def broken_verify(switch: Path, kind: str) -> Iterator[None]:
    """Breaks one piece of the CPU verify (``CPU_ENGINE_BROKEN_FILE``, read at every step) of the
    servers started with ``switch``, until the block ends."""
    switch.write_text(kind)
    try:
        yield
    finally:
        switch.write_text("")


@pytest.fixture(scope="module")
def plain_server(sglang_py, greedy_model, tmp_path_factory):
    """One plain-decoding server for the module's greedy references (it sleeps while idle): greedy
    outputs depend on the prompts only, so every test compares with the same server."""
    tmp = tmp_path_factory.mktemp("plain")
    with server(sglang_py, greedy_model, "plain", tmp, max_running=16) as srv:
        yield srv


def _sampled_logprobs_against_rescoring(srv: EngineServer, scorer: EngineServer, prompts: list[list[int]],
                                        n_tokens: int = 32) -> float:
    """Samples at temperature 1 through ``srv`` with each token's log-prob, as a trainer asks for them,
    scores every prompt + response afresh on ``scorer`` (one prefill, its input log-probs) and returns
    the largest difference."""
    sp = {"temperature": 1.0, "max_new_tokens": n_tokens, "ignore_eos": True}
    worst = 0.0
    for o, p in zip(srv.generate(prompts, sp, return_logprob=True), prompts):
        got = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        scored = scorer.generate([p + o["output_ids"]], {"temperature": 0.0, "max_new_tokens": 1},
                                 return_logprob=True, logprob_start_len=len(p) - 1)[0]
        # From the prompt's last token on; the first entry, the log-prob of that token, is left None.
        fresh = [x[0] for x in scored["meta_info"]["input_token_logprobs"][1:]]
        assert len(got) == len(fresh) == n_tokens, (len(got), len(fresh))
        worst = max(worst, float(np.abs(np.array(got) - np.array(fresh)).max()))
    return worst


def _counter(srv: EngineServer, name: str) -> float:
    """The server's counter ``name`` (``--enable-metrics``), summed over its label sets; the
    counter must be exported."""
    values = [float(line.split()[-1]) for line in srv.metrics().splitlines() if line.startswith(name + "{")]
    assert values, f"{name} is not exported"
    return sum(values)


def _plain_steps(srv: EngineServer) -> float:
    return _counter(srv, "histospec:plain_steps_total")


def _check_greedy(runs: dict[str, list[dict]], d: int = D) -> None:
    plain = runs["plain"][0]["outputs"]
    assert all(len(o) == 48 for o in plain)
    plain_logprobs = np.concatenate(runs["plain"][0]["logprobs"])
    for method, passes in runs.items():
        for i, p in enumerate(passes):
            assert p["outputs"] == plain, f"{method} pass {i + 1} differs from plain decoding"
            # The current policy's log-probs, whichever way a token was decoded (float32 model).
            assert np.abs(np.concatenate(p["logprobs"]) - plain_logprobs).max() < 1e-4, (method, i)
    assert runs["plain"][0]["steps"] == runs["plain"][0]["tokens"]
    hist = runs["history"]
    # Pass 2 drafts each response whole from pass 1's: d tokens per verify step.
    assert hist[1]["tokens"] / hist[1]["steps"] >= d - 0.5, hist[1]
    # flush_cache (SGLang runs it after every weight update) keeps HISTORY's history, not NGRAM's.
    assert hist[2]["tokens"] / hist[2]["steps"] >= d - 0.5, hist[2]
    if "ngram" in runs:
        assert runs["ngram"][2]["steps"] > 2 * hist[2]["steps"]


@pytest.mark.memory(9)
def test_greedy_http_history_equals_plain_and_ngram(sglang_py, greedy_model, plain_server, tmp_path):
    """``python -m sglang.launch_server`` over HTTP, at batch 1 and 8: HISTORY's tokens and log-probs
    equal plain decoding's and NGRAM's on every pass; a second pass accepts d tokens per step, and so
    does a pass after flush_cache. Under the default step policy (the cost model), which decodes
    some steps plainly through the target's DECODE forward and verifies the others, they equal them
    too (it verifies at each of the widths 2, 4 and d, or decodes plainly), and the plain steps are
    counted in ``histospec:plain_steps_total``; with requests waiting for a slot too (counted in
    ``histospec:waiting_steps_total``). Sampled at temperature 1,
    both return the log-probs a fresh scoring of the responses gives. The fixed-width server starts
    with every documented trainer, client, tool and test variable set, as a Ray runtime env hands
    them to an engine (tests/helpers/_scopes.py)."""
    prompts, fresh = _prompts(8), _prompts(8, seed=7)
    methods = ("ngram", "history")
    cost = server(sglang_py, greedy_model, "history", tmp_path, max_running=8, tag="default",
                  extra=["--enable-metrics"])
    switch = tmp_path / "broken"
    with running(server(sglang_py, greedy_model, "ngram", tmp_path, max_running=8),
                 # Fixed: _check_greedy counts d tokens a step from this cold server's second pass.
                 server(sglang_py, greedy_model, "history", tmp_path, max_running=8,
                        env={"CPU_ENGINE_BROKEN_FILE": str(switch), **other_scopes(tmp_path), **FIXED}),
                 cost) as servers:
        runs = {"plain": greedy_passes(plain_server, prompts)}
        runs.update({m: greedy_passes(srv, prompts) for m, srv in zip(methods, servers)})
        runs["history_cost"] = greedy_passes(cost, prompts)
        plain_steps = _plain_steps(cost)
        # At temperature 1 too, the log-probs returned are the current policy's, whether a step was
        # verified or (under the cost model) decoded plainly: each equals a fresh scoring's.
        sampled = {"history": _sampled_logprobs_against_rescoring(servers[1], plain_server, prompts),
                   "history_cost": _sampled_logprobs_against_rescoring(cost, plain_server, prompts)}
        cost_plain_steps = _plain_steps(cost)
        # After those sampled (T = 1) requests, a repeated greedy pass (verl's validation after a
        # training step) drafts as well as a fixed width: greedy and sampled requests are calibrated
        # apart, so the sampled ones' lower acceptance does not make greedy drafts look poor.
        again = greedy_passes(cost, prompts, passes=1)[0]
        # Sixteen requests at once on eight slots: eight wait in SGLang's queue while the others
        # decode, and the policy is told so (it then counts every promised token whole).
        queued = cost.generate(prompts + fresh, {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True})
        waiting_steps = _counter(cost, "histospec:waiting_steps_total")
        mismatches = _counter(cost, "histospec:context_mismatches_total")
        from histospec_sgl.bench.engine_server import step_seconds, verified_tokens, width_steps

        widths = width_steps(cost)
        costs = step_seconds(cost)
        verified = verified_tokens(cost)
        # The tree-attention stand-in is load-bearing: with a causal mask over the draft slots in place
        # of the tree mask, branching drafts attend to their siblings and the outputs go wrong (prompts
        # the server has no history for, as on a fresh server).
        plain_fresh = greedy_passes(plain_server, fresh, passes=1)[0]["outputs"]
        with broken_verify(switch, "mask"):
            broken = greedy_passes(servers[1], fresh)
    _check_greedy(runs)
    assert plain_steps > 0
    assert cost_plain_steps > plain_steps  # the sampled requests went through plain decode steps too
    # SGLang's seq_lens counts every accepted token but the root: what the worker reads to place the
    # root under the overlap scheduler (a GPU's default) holds on this real scheduler too.
    assert mismatches == 0
    # The default policy ran plain steps, d, and a narrower verify width (SGLang's verify path at 2 or
    # 4 nodes a request), with the outputs above identical all the same.
    ran = {k for k, n in widths.items() if n > 0} if widths is not None else set()
    assert {"1", str(D)} <= ran and ran & {"2", "4"}, widths
    # /metrics shows the step costs the policy measured and chose by: plain steps and d's, per batch
    # bucket (at least the bucket of the 8-request passes).
    assert {"1", str(D)} <= costs.keys(), costs
    assert all(s > 0 for by in costs.values() for s in by.values()) and "8" in costs["1"], costs
    # ... and what its verified steps were expected to bring and brought, per width and batch bucket:
    # the verify widths it ran, with draft tokens accepted (the repeated passes draft whole).
    assert verified and set(verified) <= ran - {"1"}, verified
    assert sum(pair[1] for by in verified.values() for pair in by.values()) > 0, verified
    assert max(sampled.values()) < 1e-3, sampled
    assert again["outputs"] == runs["plain"][0]["outputs"]
    assert again["tokens"] / again["steps"] >= D - 1, again
    assert waiting_steps > 0
    assert [o["output_ids"] for o in queued] == runs["plain"][0]["outputs"][2:] + plain_fresh[2:]
    assert any(p["outputs"] != plain_fresh for p in broken)


@pytest.mark.memory(5)
def test_greedy_http_with_two_tensor_parallel_ranks(sglang_py, greedy_model, plain_server, tmp_path):
    """HISTORY on two TP ranks (gloo over loopback, one core each): rank 0 drafts and broadcasts its
    drafts to rank 1 every step; the tokens equal single-rank plain decoding's, and pass 2 and the
    pass after flush_cache draft whole responses from history."""
    prompts = _prompts(8, seed=6)
    plain = greedy_passes(plain_server, prompts, passes=1)
    # Fixed: _check_greedy counts d tokens a step from this cold server's second pass.
    with server(sglang_py, greedy_model, "history", tmp_path, max_running=8, tp=2, tag="history-tp2",
                env=FIXED) as hist_srv:
        hist = greedy_passes(hist_srv, prompts)
    _check_greedy({"plain": plain, "history": hist})


@pytest.mark.memory(7)
def test_greedy_http_on_sglang_0_5_23(sglang_py, sglang_0523, greedy_model, plain_server, tmp_path):
    """The same over HTTP on SGLang 0.5.23, laid over the 0.5.17 environment (its Rust radix tree is
    built for a newer torch, so it runs SGLang's Python radix tree): its HISTORY and NGRAM equal plain
    decoding on 0.5.17, tokens and log-probs."""
    env = {"PYTHONPATH": str(sglang_0523), "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    prompts = _prompts(8, seed=1)
    methods = ("ngram", "history")
    # HISTORY fixed: _check_greedy counts d tokens a step from this cold server's second pass.
    with running(*(server(sglang_py, greedy_model, m, tmp_path, max_running=8,
                          env={**env, **FIXED} if m == "history" else env,
                          extra=["--enable-metrics"] if m == "history" else [])
                   for m in methods)) as servers:
        runs = {"plain": greedy_passes(plain_server, prompts, passes=1)}
        runs.update({m: greedy_passes(srv, prompts) for m, srv in zip(methods, servers)})
        mismatches = _counter(servers[1], "histospec:context_mismatches_total")
    _check_greedy(runs)
    assert mismatches == 0  # 0.5.23's seq_lens too counts every accepted token but the root
    version = subprocess.run([str(sglang_py), "-c", "import sglang; print(sglang.__version__)"], text=True,
                             capture_output=True, env=cpu_engine_env(str(sglang_py), base={**env}), check=True)
    assert version.stdout.strip() == "0.5.23"


def _engine_api(py: Path, model: Path, tmp_path: Path, extra_env: dict | None = None,
                methods: tuple[str, ...] = ("plain", "ngram", "history"), reload: bool = True) -> dict:
    spec = {"model": str(model), "prompts": _prompts(8, seed=2), "methods": list(methods), "reload": reload,
            "max_new_tokens": 48, "draft_tokens": D, "snapshot": str(tmp_path / "history.snap")}
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    base.update({**FIXED, **(extra_env or {})})  # _check_engine_api counts d tokens a step from a cold engine
    r = subprocess.run([str(py), str(DRIVERS / "cpu_engine_api.py"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=900, env=cpu_engine_env(str(py), base=base), cwd=str(tmp_path))
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][7:])


def _check_engine_api(res: dict) -> None:
    plain = res["plain"]["passes"][0]
    for method in ("plain", "ngram", "history"):
        for i, p in enumerate(res.get(method, {}).get("passes", [])):
            assert p["bs1"] == plain["bs1"] and p["bs_all"] == plain["bs_all"], (method, i)
    hist = res["history"]
    for p in hist["passes"][1:]:  # pass 2, and pass 3 after histospec_save, histospec_version, flush_cache
        assert p["tokens"] / p["steps"] >= D - 0.5, p
    if "loaded" not in hist:
        return
    # A fresh engine drafts little; after histospec_load of the snapshot it drafts whole responses.
    assert hist["loaded"]["bs_all"] == plain["bs_all"]
    assert hist["loaded"]["tokens"] / hist["loaded"]["steps"] >= D - 0.5
    assert hist["fresh"]["tokens"] / hist["fresh"]["steps"] < hist["loaded"]["tokens"] / hist["loaded"]["steps"]


@pytest.mark.memory(5.5)
def test_greedy_engine_api_history_equals_plain_and_ngram(sglang_py, greedy_model, tmp_path):
    """``sgl.Engine`` (what trainers embed): the same identities, plus the collective RPCs
    (histospec_save, histospec_version, histospec_load into a fresh engine)."""
    res = _engine_api(sglang_py, greedy_model, tmp_path)
    assert res["sglang"] == "0.5.17"
    _check_engine_api(res)


@pytest.mark.memory(4.5)
def test_greedy_engine_api_on_sglang_0_5_23(sglang_py, sglang_0523, greedy_model, tmp_path):
    """``sgl.Engine`` on 0.5.23: HISTORY equals plain decoding (NGRAM's equality on 0.5.23 is checked over
    HTTP above), with the collective RPCs and flush_cache."""
    res = _engine_api(sglang_py, greedy_model, tmp_path, {"PYTHONPATH": str(sglang_0523),
                                                          "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"},
                      methods=("plain", "history"), reload=False)
    assert res["sglang"] == "0.5.23"
    _check_engine_api(res)


# -- sampling ------------------------------------------------------------------------------------

PEAKED_PROMPT = [3, 7, 11, 5, 9]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
TOP_P = {**SAMPLED, "top_p": 0.8}


def _peaked(srv: EngineServer, sp: dict, rounds: int = 40, group: str | None = None) -> tuple[list[tuple], float]:
    """``rounds`` batches of 64 samples of the peaked prompt: 4-token continuations, and tokens per
    verify step over all of them."""
    return sample(srv, PEAKED_PROMPT, sp, rounds=rounds, width=64, group=group)


@pytest.fixture(scope="class")
def peaked_servers(sglang_py, peaked_model, tmp_path_factory):
    """Plain decoding, HISTORY (d=16, its verify breakable through ``switch``), HISTORY with
    ``HISTOSPEC_LENIENCE`` = 4 and HISTORY under the default policy on the peaked model, started side by side, shared by the sampling tests
    (each puts its requests in history groups of its own) and stopped after them."""
    tmp = tmp_path_factory.mktemp("peaked")
    switch = tmp / "broken"
    with running(server(sglang_py, peaked_model, "plain", tmp),
                 # Fixed, beside the default: the checks compare tokens per step at one width (exact
                 # against lenient verification, shared groups against own ones) and break its verify.
                 server(sglang_py, peaked_model, "history", tmp, draft_tokens=16,
                        env={"CPU_ENGINE_BROKEN_FILE": str(switch), **FIXED}),
                 server(sglang_py, peaked_model, "history", tmp, draft_tokens=16, tag="lenient",
                        env={"HISTOSPEC_LENIENCE": "4", **FIXED}),
                 server(sglang_py, peaked_model, "history", tmp, draft_tokens=16, tag="default",
                        extra=["--enable-metrics"])
                 ) as (plain, history, lenient, default):
        yield {"plain": plain, "history": history, "lenient": lenient, "default": default, "switch": switch}


@pytest.mark.memory(9)
class TestSampling:
    """Sampled requests on the peaked model (a class: its servers stop after it, and on two pytest
    workers it may run beside the module's greedy tests)."""

    def test_sampling_through_history_is_lossless(self, peaked_servers):
        """At temperature 1 (and with top-p 0.8), 2,560 continuations sampled through HISTORY (d=16,
        drafting from history and in-flight siblings, about 2.5 tokens per verify step) are distributed as
        plain decoding's (chi-square, p > 1e-4 for the first 2, 3 and 4 tokens). The same test rejects the
        two classic bugs at p < 1e-10: sampled requests verified greedily (SGLang's stock CPU path) and
        duplicate sibling tokens (a padding scheme that repeats a drafted token)."""
        plain_srv, srv = peaked_servers["plain"], peaked_servers["history"]
        plain = {"t1": _peaked(plain_srv, SAMPLED)[0], "top_p": _peaked(plain_srv, TOP_P)[0]}
        t1, tps = _peaked(srv, SAMPLED)
        top_p, tps_top_p = _peaked(srv, TOP_P)
        bad = {}
        for b in ("greedy-verify", "padding"):
            with broken_verify(peaked_servers["switch"], b):
                bad[b] = _peaked(srv, SAMPLED, group=b)[0]
        assert tps > 1.8 and tps_top_p > 1.8, (tps, tps_top_p)
        assert min(same_distribution(plain["t1"], t1)) > 1e-4
        assert min(same_distribution(plain["top_p"], top_p)) > 1e-4
        # The engine's default policy (the cost model over widths 2, 4, 8 and 16, or plain steps)
        # samples the same distributions, whichever width each step took.
        from histospec_sgl.bench.engine_server import width_steps

        default = peaked_servers["default"]
        for name, params in (("t1", SAMPLED), ("top_p", TOP_P)):
            seqs, _ = _peaked(default, params, group=f"default-{name}")
            assert min(same_distribution(plain[name], seqs)) > 1e-4, name
        widths = width_steps(default)
        assert widths is not None and any(n > 0 and w != "1" for w, n in widths.items()), widths
        for b, seqs in bad.items():
            assert min(same_distribution(plain["t1"], seqs)) < 1e-10, b

    def test_sampling_parameters_the_verify_path_would_change_are_decoded_plainly(self, peaked_servers):
        """``min_p`` (which SGLang's verify path ignores) and a repetition penalty (which it applies
        "relaxed"): 2,560 continuations of each, sampled through HISTORY under the default step policy
        and at a fixed width, are distributed as plain decoding's, each decoded one token a step. Each
        parameter moves plain decoding's own distribution (p < 1e-10 against plain sampling without
        it), so a request verified as if it were not set would fail."""
        plain_srv = peaked_servers["plain"]
        base = _peaked(plain_srv, SAMPLED)[0]
        for name, params in (("min_p", {**SAMPLED, "min_p": 0.3}),
                             ("repetition_penalty", {**SAMPLED, "repetition_penalty": 1.6})):
            want = _peaked(plain_srv, params)[0]
            assert min(same_distribution(base, want)) < 1e-10, name
            for tag in ("default", "history"):
                seqs, per_step = _peaked(peaked_servers[tag], params, group=f"{tag}-{name}")
                assert min(same_distribution(want, seqs)) > 1e-4, (name, tag)
                # 4 tokens: the prefill's and 3 decode steps, each plain
                assert per_step == pytest.approx(4 / 3), (name, tag, per_step)

    def test_siblings_draft_from_each_other_and_lenience_raises_acceptance(self, peaked_servers):
        """16 samples of one prompt decoding together, from no history, accept more per step when they
        share a group (drafting from each other in flight) than when each has its own
        (``custom_params.histospec_group``); and ``HISTOSPEC_LENIENCE`` = 4 accepts more than exact
        verification on the same workload."""
        srv, lenient_srv = peaked_servers["history"], peaked_servers["lenient"]
        rates = []
        for shared in (True, False):
            sps = [{**SAMPLED, "max_new_tokens": 24,
                    "custom_params": {"histospec_group": "siblings-shared" if shared else f"siblings-own-{i}"}}
                   for i in range(16)]
            outs = srv.generate([PEAKED_PROMPT] * 16, sps)
            rates.append(sum(len(o["output_ids"]) for o in outs) / sum(verify_steps(o) for o in outs))
        shared, own = rates
        _, exact = _peaked(srv, SAMPLED, rounds=8, group="exact")
        _, lenient = _peaked(lenient_srv, SAMPLED, rounds=8, group="exact")
        assert shared > own + 0.15, (shared, own)
        assert lenient > exact + 0.3, (lenient, exact)


# -- load and faults -----------------------------------------------------------------------------


def _load_requests(prompts: list[list[int]], n: int, seed: int = 3) -> list[dict]:
    """``n`` mixed requests over ``prompts`` (each prompt comes back several times, so its group has
    history): greedy of four lengths, greedy with stop tokens, sampled, and long ones aborted."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        kind = ("greedy",) * 6 + ("stop", "sampled", "abort", "greedy-eos")
        k = kind[i % len(kind)]
        sp: dict = {"temperature": 0.0, "max_new_tokens": rng.choice([8, 16, 32, 48]), "ignore_eos": True}
        if k == "stop":
            sp["stop_token_ids"] = [rng.randrange(2, 500) for _ in range(20)]
        elif k == "sampled":
            sp.update(temperature=1.0, max_new_tokens=16)
        elif k == "abort":
            sp.update(max_new_tokens=1500)
        elif k == "greedy-eos":
            sp.update(max_new_tokens=24, ignore_eos=False)
        reqs.append({"rid": f"load-{i}", "prompt": prompts[rng.randrange(len(prompts))], "sp": sp, "kind": k})
    return reqs


@pytest.mark.memory(4)
def test_load_and_faults_on_a_real_server(sglang_py, greedy_model, plain_server, tmp_path):
    """500 mixed requests, 12 at a time, against a HISTORY server synced with a draft server, while
    flush_cache runs, the draft server is killed (SIGKILL) and restarted on its port, and 20 records
    of other prompts are bulk-published to it mid-run. Every request completes (no hang, no crash),
    aborted ones end as aborted, every greedy response equals plain decoding, and the published
    history reaches the engine. Then the snapshot written at flush_cache starts a new server, whose
    first pass drafts from it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from histospec_sgl.procs import wait_port_free
    from histospec_sgl.sync.client import HistoryPublisher
    from histospec_sgl.sync.process import DraftServerProcess

    prompts, published = _prompts(40, seed=4), _prompts(20, seed=5)
    reqs = _load_requests(prompts, 500)
    greedy = [r for r in reqs if r["sp"]["temperature"] == 0.0 and r["kind"] != "abort"]
    pub_sp = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    data = tmp_path / "draft-server"
    snapshot = tmp_path / "history.snap"
    ds = DraftServerProcess(data_dir=data, log=tmp_path / "draft-server.log")
    port = ds.port
    env = {"HISTOSPEC_DRAFT_SERVER": ds.address, "HISTOSPEC_SNAPSHOT_PATH": str(snapshot)}
    got: dict[str, dict] = {}
    done = threading.Semaphore(0)
    events = []
    try:
        want = {r["rid"]: o["output_ids"] for r, o in zip(greedy, plain_server.generate(
            [r["prompt"] for r in greedy], [r["sp"] for r in greedy]))}
        want_published = [o["output_ids"] for o in plain_server.generate(published, pub_sp)]
        with server(sglang_py, greedy_model, "history", tmp_path, max_running=16, env=env,
                    extra=["--enable-metrics"]) as srv:

            def one(r: dict) -> None:
                answered = threading.Event()

                def abort_until_answered() -> None:
                    # An abort that reaches the server before the request does is a no-op: repeat it.
                    while not answered.wait(0.2):
                        srv.abort(r["rid"])

                try:
                    if r["kind"] == "abort":
                        threading.Thread(target=abort_until_answered, daemon=True).start()
                    got[r["rid"]] = srv.generate([r["prompt"]], r["sp"], rids=[r["rid"]], timeout=300)[0]
                finally:
                    answered.set()
                    done.release()

            flusher = threading.Thread(target=srv.flush_cache)  # waits for idle: beside the requests

            def faults() -> None:
                nonlocal ds
                for count in range(1, len(reqs) + 1):
                    done.acquire()
                    if count == 100:
                        flusher.start()
                        events.append("flush_cache")
                    elif count == 200:
                        ds.kill()
                        events.append("draft server killed")
                    elif count == 300:
                        wait_port_free(port)
                        ds = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data,
                                                log=tmp_path / "draft-server-2.log")
                        events.append("draft server restarted")
                    elif count == 350:
                        with HistoryPublisher(ds.address) as pub:
                            for p, resp in zip(published, want_published):
                                pub.publish(p, resp, version=1)
                            pub.flush()
                        events.append("bulk history published")

            watcher = threading.Thread(target=faults)
            watcher.start()
            with ThreadPoolExecutor(12) as pool:
                list(pool.map(one, reqs))
            watcher.join(120)
            flusher.join(120)
            assert events == ["flush_cache", "draft server killed", "draft server restarted",
                              "bulk history published"]
            assert len(got) == 500 and srv.alive()
            for r in greedy:
                assert got[r["rid"]]["output_ids"] == want[r["rid"]], r
            aborted = [got[r["rid"]] for r in reqs if r["kind"] == "abort"]
            assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in aborted)
            assert all(len(o["output_ids"]) < 400 for o in aborted)
            # History published to the draft server (never generated here) drafts these whole, once
            # the engine's follow stream has reconnected (up to 2 s of backoff) and the groups' first
            # requests have asked for it (the engine follows the groups it drafts for): every step has
            # a draft and verification accepts what it offers, at whichever width the default policy
            # verifies (after the load its clock's prices may choose 4 for a step, which says nothing
            # about the history).
            time.sleep(3)
            srv.generate(published, {**pub_sp, "max_new_tokens": 2})
            time.sleep(1)
            srv.generate(prompts[:1], pub_sp)  # a few steps: their boundaries apply what arrived
            names = ("request_steps", "covered_request_steps", "draft_tokens_offered", "draft_tokens_accepted")
            before = {n: _counter(srv, f"histospec:{n}_total") for n in names}
            outs = srv.generate(published, pub_sp)
            took = {n: _counter(srv, f"histospec:{n}_total") - before[n] for n in names}
            assert [o["output_ids"] for o in outs] == want_published
            tps = sum(len(o["output_ids"]) for o in outs) / sum(verify_steps(o) for o in outs)
            assert tps > 3, (tps, took)
            assert took["covered_request_steps"] >= 0.9 * took["request_steps"], took
            assert took["draft_tokens_accepted"] >= 0.8 * took["draft_tokens_offered"] > 0, took
            srv.flush_cache()  # saves the snapshot
            assert "Traceback" not in srv.log_tail(10 ** 7)
    finally:
        ds.kill()
    assert snapshot.exists()
    first = [r for r in greedy if r["sp"]["max_new_tokens"] == 48][:8]
    # Fixed: a cold server's first pass, counted in tokens a step.
    with server(sglang_py, greedy_model, "history", tmp_path, max_running=16, tag="reloaded",
                env={"HISTOSPEC_HISTORY_LOAD": str(snapshot), **FIXED}) as srv:
        outs = srv.generate([r["prompt"] for r in first], [r["sp"] for r in first])
    assert [o["output_ids"] for o in outs] == [want[r["rid"]] for r in first]
    assert sum(len(o["output_ids"]) for o in outs) / sum(verify_steps(o) for o in outs) >= D - 1


# -- the benchmark -------------------------------------------------------------------------------


FAKE_ENGINE = """#!{python}
import http.server, pathlib, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
launches = pathlib.Path({marker!r})
launches.write_text(launches.read_text() + f"{{port}}\\n" if launches.exists() else f"{{port}}\\n")
if len(launches.read_text().split()) == 1:
    # What SGLang prints, and then keeps running, when its HTTP port was taken before it bound it.
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {{port}}): "
          "address already in use", flush=True)
    time.sleep(600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_whose_port_was_taken_is_launched_again_on_another(tmp_path):
    """The engine stood in by a process that answers SGLang's health check: on its first launch it
    fails to bind its port as SGLang does (it prints the error and keeps running); the server is
    stopped and launched on a new port, which answers."""
    from histospec_sgl.bench.engine_server import EngineServer

    marker = tmp_path / "launches"
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable, marker=str(marker)))
    fake.chmod(0o755)
    srv = EngineServer(tmp_path, "plain", python=str(fake), device="cuda", startup_timeout=60,
                       log_path=tmp_path / "server.log")
    first = srv.port
    try:
        srv.start()
        ports = [int(p) for p in marker.read_text().split()]
        assert ports == [first, srv.port] and srv.port != first
        with urllib.request.urlopen(srv.url + "/health_generate", timeout=5) as r:
            assert r.status == 200
    finally:
        srv.stop()
    assert srv.proc is None


def test_bench_engine_methods_and_their_ratios():
    """Each method's server, and the ratios of a row: a method named with ``_sync`` runs without the
    overlap scheduler, and ``vs_plain_sync`` compares with ``plain_sync`` where a row has one; a greedy
    row says whether its outputs are plain decoding's for the same requests."""
    from histospec_sgl.bench import engine_bench as eb
    from histospec_sgl.bench import engine_rows as rows_

    assert eb.server_spec("plain_sync") == ("plain", {}, ["--sleep-on-idle", "--disable-overlap-schedule"])
    assert eb.server_spec("plain") == ("plain", {}, ["--sleep-on-idle"])
    assert eb.server_spec("history_cost_sync") == ("history", {"HISTOSPEC_CONTROL": "cost"},
                                                   ["--sleep-on-idle", "--enable-metrics", "--disable-overlap-schedule"])
    assert eb.server_spec("history_cost")[:2] == ("history", {"HISTOSPEC_CONTROL": "cost"})
    assert eb.server_spec("history")[:2] == ("history", {"HISTOSPEC_CONTROL": "fixed"})
    with pytest.raises(ValueError, match="unknown method"):
        eb.server_spec("eagle")
    # A HISTORY method may name its own draft-token count; no other method can, nor a count below 1.
    from histospec_sgl.bench.engine_methods import parse

    assert eb.server_spec("history_d4_sync") == eb.server_spec("history_sync")
    assert (parse("history_cost_d4").base, parse("history_cost_d4").width(8), parse("history").width(8)) == (
        "history_cost", 4, 8)
    for bad in ("plain_d4", "ngram_d2", "history_d0", "ngram_corpus_sync", "history_d4x", "history_sync_d4"):
        with pytest.raises(ValueError, match="unknown method"):
            parse(bad)
    assert sorted(["history_d4", "history_cost", "history", "plain"], key=lambda m: parse(m).order()) == [
        "plain", "history", "history_d4", "history_cost"]
    point = {"pass": 1, "batch_size": 4, "temperature": 1.0, "siblings": 1}
    rows = [{"method": "plain", **point, "tokens_per_s": 100.0, "step_ms": 10.0, "tokens_per_s_runs": [90, 100, 120]},
            {"method": "plain_sync", **point, "tokens_per_s": 105.0, "step_ms": 9.5,
             "tokens_per_s_runs": [105, 105, 105]},
            {"method": "history_cost", **point, "tokens_per_s": 84.0, "step_ms": 12.0,
             "tokens_per_s_runs": [72, 84, 120]},
            {"method": "history", **point, "batch_size": 16, "tokens_per_s": 50.0, "step_ms": 20.0,
             "tokens_per_s_runs": [50]}]
    rows_.ratios(rows)
    assert (rows[2]["vs_plain"], rows[2]["vs_plain_sync"], rows[2]["verify_cost"]) == (0.84, 0.8, 1.2)
    # Each run against the plain run of its repeat: the host's drift between repeats cancels.
    assert rows[2]["vs_plain_runs"] == [0.8, 0.84, 1.0]
    # The default's verified-step tallies (draft tokens expected, accepted) per width and batch
    # bucket: a row's, the counters after it less before; the row's runs summed.
    assert rows_.tallies([{"4": {"8": [12.0, 7.0], "64": [3.0, 1.0]}, "8": {"8": [2.0, 2.0]}}],
                         {"4": {"8": [2.0, 1.0], "64": [3.0, 1.0]}, "8": {"8": [2.0, 2.0]}}) == {"4": {"8": [10.0, 6.0]}}
    runs = [{"tokens_per_s": t, "verified_tokens": {"4": {"8": [10.0, 6.0]}}} for t in (1.0, 2.0)]
    assert rows_.median_row(runs)["verified_tokens"] == {"4": {"8": [20.0, 12.0]}}
    assert rows[1]["vs_plain"] == 1.05 and rows[1]["vs_plain_sync"] == 1.0
    assert "vs_plain" not in rows[3] and "vs_plain_sync" not in rows[3]  # no plain row at batch 16
    greedy = {"pass": 1, "batch_size": 2, "temperature": 0.0, "siblings": 1}
    rows = [{"method": "plain", **greedy, "_outputs": [[1, 2], [3, 4]]},
            {"method": "history", **greedy, "_outputs": [[1, 2], [3, 4]]},
            {"method": "history_cost", **greedy, "_outputs": [[1, 2], [3, 5]]},
            {"method": "history", **point, "_outputs": [[1]]},
            {"method": "ngram", **greedy, "batch_size": 16, "_outputs": [[1]]}]
    rows_.identical(rows)
    assert [r["identical_to_plain"] for r in rows] == [True, True, False, None, None]
    assert all("_outputs" not in r for r in rows)


@pytest.mark.memory(5)
def test_bench_engine_writes_rows_for_every_point(sglang_py, greedy_model, tmp_path):
    """``histospec-sgl bench engine`` on the CPU engine, shrunk: its JSON has the documented keys and a
    row for every method, pass, batch size, temperature and sibling count; on the second greedy pass
    HISTORY emits more than one token per forward pass and plain decoding exactly one."""
    out = tmp_path / "engine.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "bench", "engine", "--model", str(greedy_model),
                        "--methods", "plain,history", "--batch-sizes", "1,4", "--temperatures", "0,1",
                        "--siblings", "4", "--max-new-tokens", "16", "--sampled-requests", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert {"machine", "model", "rows", "settings", "command"} <= res.keys()
    assert res["machine"]["sglang"] == "0.5.17" and res["model"]["kind"] == "random"
    points = {(x["method"], x["pass"], x["batch_size"], x["temperature"], x["siblings"]) for x in res["rows"]}
    want = {(m, p, b, t, n) for m in ("plain", "history") for p in (1, 2) for b in (1, 4) for t in (0.0, 1.0)
            for n in ((1, 4) if t and b == 4 else (1,))}
    assert points == want
    assert res["settings"]["sampled_requests"] == 4 and res["settings"]["fixed_length"] is False
    for x in res["rows"]:
        assert x["tokens_per_s"] > 0 and x["vs_plain"] > 0 and x["verify_cost"] > 0
        # Every server runs SGLang's overlap scheduler (on a CPU as on a GPU); greedy rows are plain
        # decoding's tokens, and HISTORY's contexts never disagreed with SGLang's.
        assert x["overlap"] is True, x
        # The prompt tokens, and those SGLang's radix cache covered: none shared on the first pass
        # (bar the chat template's), all but the one token each of the 4 requests computes on the
        # second, which repeats the first's prompts; the server's prefill chunk as it resolved it.
        assert x["prompt_tokens"] > 4 and 0 <= x["cached_tokens"] < x["prompt_tokens"], x
        if x["pass"] == 2:
            assert x["prompt_tokens"] - x["cached_tokens"] == 4, x
        assert x["prefill_chunk"] is None or x["prefill_chunk"] >= 1024, x
        assert x["identical_to_plain"] is (True if x["temperature"] == 0.0 else None), x
        assert x["context_mismatches"] == (0 if x["method"] == "history" else None), x
        # Every request runs to 16 tokens: greedy rows run one batch (at batch 1, four requests one
        # after the other), sampled rows batches until 4 requests.
        assert x["tokens"] == 16 * 4, x
        if x["method"] == "plain":
            assert x["tokens_per_step"] == 1.0
        elif x["pass"] == 2 and x["temperature"] == 0.0:
            assert x["tokens_per_step"] > 2.0, x
    assert "history" in r.stdout and "tokens_per_step" in r.stdout
    # The same result as a measured step-cost profile for simulate: plain steps at width 1, HISTORY's
    # verify steps at width d, per batch size.
    prof = tmp_path / "profile.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "bench", "profile", "--engine-json", str(out),
                        "--out", str(prof)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(prof.read_text())
    assert p["analytic"] is False and "measured" in p["description"]
    assert {(x["batch"], x["width"]) for x in p["points"]} == {(b, w) for b in (1, 4) for w in (1, 8)}
    assert all(x["step_s"] > 0 for x in p["points"])


ORPHAN_ENGINE = """#!{python}
import ctypes, http.server, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
# Like SGLang's scheduler and detokenizer: a child that dies with the launcher (PR_SET_PDEATHSIG).
child = subprocess.Popen([sys.executable, "-c", "import ctypes, signal, time; "
                          "ctypes.CDLL(None).prctl(1, signal.SIGKILL); time.sleep(600)"])
print("CHILD", child.pid, flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

HARNESS = """
import sys, time
from histospec_sgl.bench.engine_server import EngineServer, running
with running(EngineServer(sys.argv[1], "plain", python=sys.argv[2], device="cuda", startup_timeout=60,
                          log_path=sys.argv[3])) as (srv,):
    print("SERVER", srv.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_harness_leaves_no_server_behind(tmp_path, sig):
    """A process that started engine servers and is killed (SIGTERM, or SIGKILL, which runs no
    cleanup) leaves none behind: each server's launcher dies with the thread that started it, and
    the launcher's own children (SGLang's scheduler and detokenizer, stood in here by a child that
    dies with its parent as they do) with it."""
    import os
    import signal

    fake = tmp_path / "fake_python"
    fake.write_text(ORPHAN_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "server.log"
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path), str(fake), str(log)],
                               stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    line = harness.stdout.readline()
    assert line.startswith("SERVER"), line
    server = int(line.split()[1])
    deadline = time.monotonic() + 30
    while "CHILD" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(log.read_text().split("CHILD")[1].split()[0])

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    assert alive(server) and alive(child)
    os.kill(harness.pid, getattr(signal, sig))
    harness.wait(30)
    harness.stdout.close()
    deadline = time.monotonic() + 30
    while (alive(server) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server) and not alive(child)
