"""A real model decoding through ``--speculative-algorithm HISTORY``: SGLang's own server and Engine
processes, scheduler, radix cache, memory pools, Llama model code, logits processor, sampler and NGRAM's
whole verify path, on this machine's CPU, with a small Llama built locally
(:mod:`histospec_sgl.bench.engine_models`).

What is stood in, in test support only (``bench/cpu_engine`` with its ``stubs``; see their
docstrings): tree attention for the verify forward of SGLang's ``torch_native`` backend, SGLang's
sampling-verify branch on CPU, and plain-torch restatements of the sgl-kernel ops SGLang calls there.
Each is shown load-bearing here: ``CPU_ENGINE_BROKEN_FILE`` breaks one for a while on a running server,
and the checks that pass without it fail with it.

Here: greedy decoding over HTTP (tokens and log-probs against one plain server the module shares),
on two tensor-parallel ranks, and a load with faults. ``sgl.Engine`` and the benchmark harness are in
test_engine_cpu_api.py, sampled requests in test_engine_cpu_sampling.py, SGLang 0.5.23 over HTTP in
test_lossless.py: modules of their own, so that pytest workers can run them side by side.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from _engine_checks import FIXED, broken_verify, greedy_passes, server
from _engine_checks import random_prompts as _prompts
from _scopes import other_scopes

from histospec_sgl.bench.engine_server import EngineServer, running, verify_steps

D = 8
#: Each test starts two to four SGLang servers (15-30 s each on two cores), side by side.
pytestmark = pytest.mark.timeout(900)


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


@pytest.mark.memory(10)
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


@pytest.mark.memory(4.5)
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
            # Each abort is repeated every 0.2 s until it lands (one sent before the request reaches
            # the scheduler is a no-op), and a request drafted whole decodes hundreds of tokens in
            # that time on a fast host (the longest 254-413 in six runs here): every aborted request ends
            # well before its cap of 1500, and most within about a tenth of it (medians 74-92).
            lengths = sorted(len(o["output_ids"]) for o in aborted)
            assert lengths[-1] < 1000 and lengths[len(lengths) // 2] < 400, lengths
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
