"""Sampled requests through HISTORY on this machine's CPU (test_engine_cpu.py's docstring says what
is stood in), on a small Llama whose next-token distribution is peaked, so that drafts from history
and in-flight siblings are accepted often: sampled continuations are distributed as plain
decoding's (chi-square), under a fixed width and the default step policy, with the parameters the
verify path would change decoded plainly; siblings draft from each other; lenience raises
acceptance. The CPU verify's stand-ins are shown load-bearing here as in test_engine_cpu.py.
"""

from __future__ import annotations

import pytest
from _engine_checks import FIXED, broken_verify, same_distribution, sample, server

from histospec_sgl.bench.engine_server import EngineServer, running, verify_steps

#: Four SGLang servers side by side (15-30 s each to start on two cores).
pytestmark = pytest.mark.timeout(900)


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


@pytest.mark.memory(8.5)
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
