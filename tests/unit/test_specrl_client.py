"""SpecRLRollout against a loopback HTTP server that speaks SGLang's native ``/generate`` (the
response layout of SGLang 0.5.17's tokenizer manager: ``output_ids``, ``meta_info.finish_reason``
as ``{"type": ...}``, ``input_token_logprobs`` / ``output_token_logprobs`` as
``[logprob, token_id, text]`` from ``logprob_start_len``) over a small synthetic policy with explicit
next-token distributions, so that every returned log-prob can be checked against the policy.

No GPU is involved; tests/trainers/test_slime.py runs the same client against a real SGLang server
on the CPU engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from histospec_sgl.specrl.acceptance import SpecRLError
from histospec_sgl.specrl.client import (
    Previous,
    PreviousResponses,
    RolloutRequest,
    SpecRLRequestError,
    SpecRLRollout,
    engine_backend,
    scored_logprobs,
)

V, EOS = 6, 0


class Policy:
    """p(next | last two tokens), explicit; ``shift`` moves it away from another policy."""

    def __init__(self, seed: int, shift: float = 0.0):
        rng = np.random.default_rng(seed)
        self.logits = rng.normal(size=(V * V, V)) * 1.5
        self.logits[:, EOS] -= 1.5  # responses of a few tokens
        if shift:
            self.logits += np.random.default_rng(seed + 1).normal(size=self.logits.shape) * shift

    def logp(self, ctx: list[int]) -> np.ndarray:
        ctx = [0, 0, *ctx]  # contexts shorter than two tokens (scoring from the prompt's start)
        z = self.logits[(ctx[-2] % V) * V + ctx[-1] % V]
        return z - np.log(np.exp(z - z.max()).sum()) - z.max()

    def sample(self, ctx: list[int], max_new: int, rng: np.random.Generator) -> tuple[list[int], list[float], str]:
        out, lps = [], []
        while len(out) < max_new:
            lp = self.logp(ctx + out)
            t = int(rng.choice(V, p=np.exp(lp)))
            out.append(t)
            lps.append(float(lp[t]))
            if t == EOS:
                return out, lps, "stop"
        return out, lps, "length"


class FakeSGLang:
    """A real HTTP server on loopback answering ``/generate`` like SGLang, from ``policy``."""

    def __init__(self, policy: Policy, *, offset: int = 0, fail_on: set[int] | None = None, delay: float = 0.0):
        self.policy, self.offset, self.fail_on, self.delay = policy, offset, fail_on or set(), delay
        self.calls: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        self.rng = np.random.default_rng(1234)
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.calls.append(body)
                    outer.inflight += 1
                    outer.max_inflight = max(outer.max_inflight, outer.inflight)
                done = False

                def answered():
                    # A request stops counting before its answer is written: once the client
                    # has the answer it may send its next request while this thread still
                    # runs, and counting until after the write would see one request too many.
                    nonlocal done
                    if not done:
                        done = True
                        with outer.lock:
                            outer.inflight -= 1

                try:
                    time.sleep(outer.delay)
                    if body["input_ids"][0] in outer.fail_on:
                        answered()
                        self.send_response(500)
                        self.end_headers()
                        self.wfile.write(b'{"error": "simulated engine failure"}')
                        return
                    data = json.dumps(outer.answer(body)).encode()
                    answered()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    try:
                        self.wfile.write(data)
                    except BrokenPipeError:  # the client gave up (the timeout test)
                        pass
                finally:
                    answered()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> dict:
        ids = body["input_ids"]
        sp = body["sampling_params"]
        with self.lock:
            out, lps, fin = self.policy.sample(ids, sp["max_new_tokens"], self.rng)
        meta = {"id": "x", "finish_reason": {"type": fin, **({"matched": EOS} if fin == "stop" else {"length": len(out)})},
                "prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            if start == -1:
                start = len(ids)
            start = max(0, start - self.offset)
            meta["input_token_logprobs"] = [
                [None if i == 0 else float(self.policy.logp(ids[:i])[ids[i]]), ids[i], None] for i in range(start, len(ids))]
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(out, lps)]
        return {"text": None, "output_ids": out, "meta_info": meta}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def policy_pair():
    return Policy(3), Policy(3, shift=0.7)


def _requests(n: int, old: Policy | None, rng: np.random.Generator, max_new: int = 12) -> list[RolloutRequest]:
    reqs = []
    for i in range(n):
        prompt = [1 + i % 5, 1 + (i * 7) % 5, 2]
        prev = None
        if old is not None:
            ids, lps, fin = old.sample(prompt, max_new, rng)
            prev = Previous(ids, lps, fin)
        reqs.append(RolloutRequest(prompt, {"temperature": 1.0, "max_new_tokens": max_new}, prev, name=f"q{i}",
                                   sample_index=i))
    return reqs


def _check_current_policy_logprobs(results, reqs, new: Policy):
    for res, req in zip(results, reqs):
        ctx = list(req.prompt_ids)
        assert len(res.logprobs) == len(res.response_ids)
        for t, lp in zip(res.response_ids, res.logprobs):
            assert lp == pytest.approx(float(new.logp(ctx)[t]), abs=1e-9)
            ctx.append(t)
        assert res.reused + res.generated == len(res.response_ids)


def test_rollout_over_http_assembles_current_policy_logprobs(policy_pair):
    old, new = policy_pair
    srv = FakeSGLang(new)
    try:
        reqs = _requests(40, old, np.random.default_rng(0))
        roll = SpecRLRollout.http(srv.url, lenience=1.0, rng=np.random.default_rng(7), concurrency=4)
        results = roll.rollout_sync(reqs)
        _check_current_policy_logprobs(results, reqs, new)
        c = roll.counters
        assert c.requests == 40 and c.with_previous == 40
        assert c.verified == sum(len(r.previous.response_ids) for r in reqs)
        assert 0 < c.reused < c.verified  # some tokens reused, some rejected
        assert srv.max_inflight <= 4
        # Scoring calls start the log-probs at the prompt's end; continuations carry only the
        # accepted prefix and a reduced budget.
        scores = [b for b in srv.calls if b.get("logprob_start_len", -1) >= 0]
        assert len(scores) == 40 and all(b["sampling_params"]["max_new_tokens"] == 1 for b in scores)
        for res, req in zip(results, reqs):
            if res.generated:
                cont = next(b for b in srv.calls if b["input_ids"] == list(req.prompt_ids) + res.response_ids[:res.reused]
                            and b.get("logprob_start_len") == -1)
                assert cont["sampling_params"]["max_new_tokens"] == 12 - res.reused
    finally:
        srv.close()


def test_lenience_raises_reuse_and_identical_policies_reuse_everything(policy_pair):
    old, new = policy_pair
    srv = FakeSGLang(new)
    try:
        fractions = []
        for ell in (1.0, 2.0, 8.0, float("inf")):
            reqs = _requests(60, old, np.random.default_rng(0))
            roll = SpecRLRollout.http(srv.url, lenience=ell, rng=np.random.default_rng(1))
            roll.rollout_sync(reqs)
            fractions.append(roll.counters.verified and roll.counters.reused / roll.counters.verified)
        assert fractions == sorted(fractions) and fractions[-1] > fractions[0]
        # ℓ = ∞ keeps every token the new policy can produce: all of them here.
        assert fractions[-1] == 1.0
    finally:
        srv.close()
    same = FakeSGLang(old)
    try:
        reqs = _requests(30, old, np.random.default_rng(5))
        roll = SpecRLRollout.http(same.url, lenience=1.0, rng=np.random.default_rng(2))
        results = roll.rollout_sync(reqs)
        # p_new == p_old: every token accepted; responses that had ended are returned as they were,
        # without a generation call.
        for res, req in zip(results, reqs):
            assert res.response_ids[: len(req.previous.response_ids)] == list(req.previous.response_ids)
            if req.previous.finish_reason == "stop":
                assert res.generated == 0 and res.finish_reason == "stop"
        assert roll.counters.fully_reused == sum(r.previous.finish_reason in ("stop", "length") for r in reqs)
    finally:
        same.close()


def test_history_store_feeds_the_next_epoch_and_no_history_generates(policy_pair):
    old, new = policy_pair
    srv = FakeSGLang(new)
    try:
        store = PreviousResponses()
        roll = SpecRLRollout.http(srv.url, rng=np.random.default_rng(3), history=store)
        first = roll.rollout_sync(_requests(10, None, np.random.default_rng(0)))
        assert all(r.reused == 0 and r.verified == 0 for r in first) and len(store) == 10
        n_calls = len(srv.calls)
        second = roll.rollout_sync(_requests(10, None, np.random.default_rng(0)))
        assert any(r.reused > 0 for r in second)  # same policy: the first epoch's responses are reused
        assert len(srv.calls) > n_calls
        # Draft-server records with log-probs fill the store too (records without them are skipped).
        recs = [{"group_key": 5, "sample_index": 1, "response_ids": [3, 4], "logprobs": [-0.1, -0.2], "version": 1},
                {"group_key": 6, "sample_index": 0, "response_ids": [3, 4], "logprobs": None}]
        assert store.add_records(recs) == 1 and store.get(5, 1).response_ids == [3, 4]
    finally:
        srv.close()


def test_previous_responses_from_a_real_draft_server(tmp_path, policy_pair):
    """A trainer publishes last epoch's responses with their log-probs; the next epoch's SPEC-RL
    rollout reads them from the server (keyed by prompt_key, as the server fills group keys)."""
    from histospec_sgl.sync.client import HistoryPublisher
    from histospec_sgl.sync.process import DraftServerProcess

    old, new = policy_pair
    reqs = _requests(6, old, np.random.default_rng(0))
    with DraftServerProcess(log=tmp_path / "server.log") as ds:
        with HistoryPublisher(ds.address) as pub:
            for r in reqs:
                pub.publish(r.prompt_ids, r.previous.response_ids, logprobs=r.previous.logprobs, version=3,
                            sample_index=r.sample_index)
            pub.publish([9, 9], [1, 2])  # no log-probs: cannot be verified, skipped
        store = PreviousResponses.from_draft_server(ds.address)
    assert len(store) == 6
    srv = FakeSGLang(new)
    try:
        fresh = [RolloutRequest(r.prompt_ids, r.sampling_params, None, name=r.name, sample_index=r.sample_index)
                 for r in reqs]
        roll = SpecRLRollout.http(srv.url, rng=np.random.default_rng(0), history=store)
        results = roll.rollout_sync(fresh)
        assert roll.counters.with_previous == 6
        assert roll.counters.verified == sum(len(r.previous.response_ids) for r in reqs)
        _check_current_policy_logprobs(results, fresh, new)
    finally:
        srv.close()


def test_alignment_offset_and_misalignment():
    meta = {"input_token_logprobs": [[None, 9, None], [-0.5, 3, None], [-0.25, 4, None]]}
    assert scored_logprobs(meta, [3, 4]).tolist() == [-0.5, -0.25]  # one position early: skipped
    assert scored_logprobs({"input_token_logprobs": [[-0.5, 3, None], [-0.25, 4, None]]}, [3, 4]).tolist() == [-0.5, -0.25]
    with pytest.raises(ValueError, match="do not line up"):
        scored_logprobs(meta, [4, 3])


def test_server_offset_by_one_is_handled(policy_pair):
    old, new = policy_pair
    srv = FakeSGLang(new, offset=1)
    try:
        reqs = _requests(10, old, np.random.default_rng(0))
        results = SpecRLRollout.http(srv.url, rng=np.random.default_rng(7)).rollout_sync(reqs)
        _check_current_policy_logprobs(results, reqs, new)
    finally:
        srv.close()


def test_errors_name_the_request_and_step(policy_pair):
    old, new = policy_pair
    srv = FakeSGLang(new, fail_on={4})
    try:
        reqs = _requests(8, old, np.random.default_rng(0))  # q3 has prompt [4, ...]
        with pytest.raises(SpecRLRequestError, match=r"request 'q3': score: RuntimeError: HTTP 500"):
            SpecRLRollout.http(srv.url, rng=np.random.default_rng(0)).rollout_sync(reqs)
    finally:
        srv.close()
    slow = FakeSGLang(new, delay=2.0)
    try:
        with pytest.raises(SpecRLRequestError, match=r"request 'q0': generate: no answer within 0.3 s"):
            SpecRLRollout.http(slow.url, rng=np.random.default_rng(0), timeout=0.3).rollout_sync(
                _requests(1, None, np.random.default_rng(0)))
    finally:
        slow.close()
    with pytest.raises(SpecRLRequestError, match="request 'q0': generate: .*Connection refused"):
        SpecRLRollout.http("http://127.0.0.1:9", rng=np.random.default_rng(0)).rollout_sync(
            _requests(1, None, np.random.default_rng(0)))
    bad = Previous([1, 2], [-0.1, float("nan")])
    srv = FakeSGLang(new)
    try:
        with pytest.raises(SpecRLRequestError, match=r"request 'x': cut: .*NaN"):
            SpecRLRollout.http(srv.url, rng=np.random.default_rng(0)).rollout_sync(
                [RolloutRequest([1, 2, 3], {"max_new_tokens": 4}, bad, name="x")])
    finally:
        srv.close()
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        Previous([1, 2], [-0.1])
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        SpecRLRollout.http("http://127.0.0.1:9", rng=0)


def test_engine_backend(policy_pair):
    """The sgl.Engine path: ``engine.async_generate(**payload)`` returns the same dict as HTTP."""
    old, new = policy_pair
    fake = FakeSGLang(new)
    fake.close()  # only its answer() is used

    class Engine:
        async def async_generate(self, **payload):
            await asyncio.sleep(0)
            return fake.answer(payload)

    reqs = _requests(12, old, np.random.default_rng(0))
    roll = SpecRLRollout(engine_backend(Engine()), rng=np.random.default_rng(0))
    _check_current_policy_logprobs(roll.rollout_sync(reqs), reqs, new)


def test_previous_responses_follow_a_draft_server_live(tmp_path):
    """follow(): the store mirrors the server's records as they are published, keeps the newest
    version per (group, slot), and catches up after the server restarts on its port."""
    from histospec_sgl.procs import wait_port_free
    from histospec_sgl.sync.client import HistoryPublisher
    from histospec_sgl.sync.process import DraftServerProcess

    data = tmp_path / "data"
    ds = DraftServerProcess(data_dir=data, log=tmp_path / "server.log")
    store = PreviousResponses.follow(ds.address)
    try:
        with HistoryPublisher(ds.address) as pub:
            pub.publish([1, 2, 3], [4, 5], group=77, sample_index=0, logprobs=[-0.1, -0.2], version=1)
            pub.publish([1, 2, 3], [6, 7, 8], group=77, sample_index=1, logprobs=[-0.3, -0.4, -0.5], version=1)
            pub.flush()
            store.wait_for(pub.last_sequence, timeout=30)
        assert store.get(77, 0).response_ids == [4, 5] and store.get(77, 1).version == 1
        port = ds.port
        ds.kill()
        wait_port_free(port)
        ds = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data, log=tmp_path / "server-2.log")
        with HistoryPublisher(ds.address) as pub:
            pub.publish([1, 2, 3], [9], group=77, sample_index=0, logprobs=[-0.7], version=2)
            pub.flush()
            store.wait_for(pub.last_sequence, timeout=30)
        assert store.get(77, 0).response_ids == [9] and store.get(77, 0).version == 2
        assert store.get(77, 1).response_ids == [6, 7, 8]
    finally:
        store.close()
        ds.kill()


class AbortingSGLang(FakeSGLang):
    """Answers like SGLang for a request it aborted (the trainer's abort): ``finish_reason`` abort,
    and for a prefill that never ran no log-probs at all."""

    def __init__(self, policy: Policy, abort: str):
        super().__init__(policy)
        self.abort = abort  # "score" or "continue"

    def answer(self, body: dict) -> dict:
        scoring = body["sampling_params"]["max_new_tokens"] == 1 and body.get("logprob_start_len", -1) >= 0
        if (self.abort == "score") == scoring:
            return {"text": None, "output_ids": [],
                    "meta_info": {"id": "x", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                                  "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0}}
        return super().answer(body)


def test_an_aborted_request_comes_back_aborted_not_as_an_error(policy_pair):
    """An abort (slime's ``abort()``, verl's ``abort_all_requests``) during the scoring call gives an
    aborted result with nothing reused; during the continuation, the reused prefix with the current
    policy's log-probs; and once the trainer's abort flag is set, no call is sent at all."""
    new, old = policy_pair
    rng = np.random.default_rng(5)
    reqs = _requests(6, old, rng)
    for where in ("score", "continue"):
        srv = AbortingSGLang(new, where)
        try:
            res = SpecRLRollout.http(srv.url, rng=np.random.default_rng(0)).rollout_sync(reqs)
        finally:
            srv.close()
        with_previous = [r for r in res if r.previous_len]
        assert with_previous
        if where == "score":
            assert all(r.finish_reason == "abort" for r in with_previous)
        else:  # a request whose whole previous response was kept sends no continuation
            assert any(r.finish_reason == "abort" for r in with_previous)
            assert all(r.finish_reason == "abort" or r.reused == r.previous_len for r in with_previous)
        for r, q in zip(res, reqs):
            assert len(r.response_ids) == len(r.logprobs)
            if where == "score":
                assert r.response_ids == [] and r.reused == 0
            elif r.finish_reason == "abort":
                assert r.response_ids == list(q.previous.response_ids[: r.reused]) and r.generated == 0
                ctx = list(q.prompt_ids)
                for t, lp in zip(r.response_ids, r.logprobs):  # the current policy's log-probs
                    assert lp == pytest.approx(float(new.logp(ctx)[t]), abs=1e-6)
                    ctx.append(t)
    srv = FakeSGLang(new)
    try:
        flag = {"set": False}
        client = SpecRLRollout.http(srv.url, rng=np.random.default_rng(0), aborted=lambda: flag["set"])
        flag["set"] = True
        res = client.rollout_sync(reqs)
        assert all(r.finish_reason == "abort" and r.response_ids == [] for r in res) and srv.calls == []
    finally:
        srv.close()


def test_reuse_scores_and_cuts_without_generating(policy_pair):
    """``reuse`` (what each trainer adapter calls before handing the rest to the trainer's own
    generate) sends one scoring call and returns the kept prefix with the current policy's
    log-probs, the budget left, and whether anything is left to generate."""
    new, old = policy_pair
    reqs = _requests(8, old, np.random.default_rng(3))
    srv = FakeSGLang(new)
    try:
        client = SpecRLRollout.http(srv.url, rng=np.random.default_rng(1))
        for q in reqs:
            before = len(srv.calls)
            r = asyncio.run(client.reuse(q.prompt_ids, q.sampling_params, q.previous))
            assert len(srv.calls) == before + 1
            assert r.prefix == list(q.previous.response_ids[: len(r.prefix)])
            ctx = list(q.prompt_ids)
            for t, lp in zip(r.prefix, r.logprobs):
                assert lp == pytest.approx(float(new.logp(ctx)[t]), abs=1e-9)
                ctx.append(t)
            if r.done:
                assert r.finish_reason in ("stop", "length") and r.max_new_tokens == 0
            else:
                assert r.finish_reason is None and r.max_new_tokens == 12 - len(r.prefix) > 0
        with pytest.raises(SpecRLRequestError, match="empty previous response"):
            asyncio.run(client.reuse([1, 2], {"max_new_tokens": 4}, Previous([], [])))
    finally:
        srv.close()


def test_one_reuse_rule_for_every_trainer():
    """The guard every trainer adapter calls: plain sampling at temperature 1 reuses; evaluation,
    another temperature, truncation, penalties, constrained decoding, slime's top-p replay and
    min-tokens above 1 do not. Dicts (SGLang, slime, verl) and objects (vLLM) read the same."""
    from types import SimpleNamespace

    from histospec_sgl.specrl.guard import Options, reuse_blocker

    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 8, "logprobs": True,
             "repetition_penalty": 1.0, "min_tokens": 1}
    assert reuse_blocker(plain) is None and reuse_blocker({}) is None
    assert reuse_blocker(SimpleNamespace(**plain)) is None
    assert reuse_blocker(plain, evaluation=True) == "evaluation"
    for change, reason in [({"temperature": 0}, "temperature=0"), ({"temperature": 0.7}, "temperature=0.7"),
                           ({"top_p": 0.95}, "top_p=0.95"), ({"top_k": 50}, "top_k=50"),
                           ({"min_p": 0.1}, "min_p=0.1"), ({"frequency_penalty": 0.5}, "frequency_penalty=0.5"),
                           ({"json_schema": "{}"}, "json_schema"), ({"regex": "a+"}, "regex"),
                           ({"min_new_tokens": 5}, "min_new_tokens=5"),
                           ({"custom_params": {"return_top_p_token_ids": True}}, "return_top_p_token_ids")]:
        assert reuse_blocker({**plain, **change}) == reason
        assert reuse_blocker(SimpleNamespace(**{**plain, **change})) == reason
    assert Options.resolve().timeout == 600.0
    assert Options.resolve(timeout="30", lenience=2).timeout == 30.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="timeout"):
            Options.resolve(timeout=bad)
    with pytest.raises(SpecRLError, match="lenience"):
        Options.resolve(lenience=0.5)


def test_one_flow_draws_the_same_for_the_same_sample_in_every_trainer():
    """specrl/flow.py is the flow every adapter runs: the acceptance draws of a reuse come from (seed,
    group, slot, round) alone, so the same sample cuts its previous response at the same place in
    slime, verl and OpenRLHF, and run after run (no clock, no random id); another round draws anew."""
    from histospec_sgl.specrl import flow
    from histospec_sgl.specrl.guard import Options

    prev = Previous(list(range(10, 50)), [-1.0] * 40, "stop")

    async def engine(payload: dict, timeout: float) -> dict:
        # The scoring prefill of prompt + previous response: each token at half its old probability.
        start = payload["logprob_start_len"]
        return {"meta_info": {"input_token_logprobs": [[-1.0 - np.log(2), t, None] for t in payload["input_ids"][start:]],
                              "finish_reason": {"type": "length"}}}

    def cut(**kw: int) -> int:
        r = asyncio.run(flow.reuse(engine, Options(seed=3), prompt_ids=[1, 2, 3], sampling_params={"max_new_tokens": 64},
                                   previous=prev, **kw))
        return len(r.prefix)

    first = cut(group=2**63 + 7, slot=1, round_=0)
    assert first == cut(group=2**63 + 7, slot=1, round_=0) < 40
    assert len({first} | {cut(group=2**63 + 7, slot=1, round_=r) for r in range(1, 12)}) > 1
    assert flow.seed_sequence(3, 2**63 + 7, 1, 0).entropy == flow.seed_sequence(3, 2**63 + 7, 1, 0).entropy
    with pytest.raises(ValueError, match=">= 0"):
        flow.seed_sequence(0, 1, -1, 0)
    rounds = flow.SlotCounter()
    assert [rounds.count((5, 0)), rounds.count((5, 1)), rounds.count((5, 0))] == [0, 0, 1]
    assert [rounds.take(7, 3) for _ in range(4)] == [0, 1, 2, 0]
