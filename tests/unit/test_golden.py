"""Golden numbers: tokens per verify step of ours and of each built-in peer on the shipped sample
and on fixed slices of the shared rollout logs, exact to four decimals.

Any change to what is drafted (the index's policy, a peer's driver, the replay's accounting) moves
one of these, and the commit that moves it says why and gives the new values (and, for ours, the
full replay suite's before and after). Regenerate with
``PYTHONPATH=tests python tests/unit/test_golden.py``.
"""

from __future__ import annotations

import sys

import pytest

from histospec_sgl.replay.run import ReplayOptions, run_replay

PEERS = ("ngram", "sglang_trie_per_prompt", "sglang_trie_global")

#: (options, {method: tokens per verify step}); the presets other than humaneval-sample read
#: ../shared/data/rollouts, sliced by the preset's seeded choice of ``max_groups`` groups.
GOLDEN: list[tuple[dict, dict[str, float]]] = [
    ({"preset": "humaneval-sample", "scenario": "cross-sample"},
     {"ours": 2.8165, "ngram": 2.3039, "sglang_trie_per_prompt": 2.7361, "sglang_trie_global": 2.7317}),
    ({"preset": "humaneval-sample", "scenario": "cold"},
     {"ours": 1.3840, "ngram": 1.3291, "sglang_trie_per_prompt": 1.3764, "sglang_trie_global": 1.3525}),
    ({"preset": "humaneval-sample", "scenario": "cross-sample-inflight"},
     {"ours": 1.6930, "ngram": 1.3639, "sglang_trie_per_prompt": 1.6462, "sglang_trie_global": 1.6449}),
    ({"preset": "humaneval-sample", "scenario": "cross-sample", "draft_tokens": 8},
     {"ours": 2.5205, "ngram": 2.1974, "sglang_trie_per_prompt": 2.4487, "sglang_trie_global": 2.4427}),
    ({"preset": "grpo", "scenario": "cross-sample", "max_groups": 4},
     {"ours": 5.0799, "ngram": 3.8173, "sglang_trie_per_prompt": 4.7332, "sglang_trie_global": 4.7381}),
    ({"preset": "grpo", "scenario": "cross-sample", "max_groups": 4, "chain": True},
     {"ours": 4.7479}),
    ({"preset": "grpo", "scenario": "cross-epoch", "max_groups": 4},
     {"ours": 2.5952, "ngram": 2.1810, "sglang_trie_per_prompt": 2.5441, "sglang_trie_global": 1.8384}),
    ({"preset": "grpo", "scenario": "cross-sample-inflight", "max_groups": 4},
     {"ours": 3.3409, "ngram": 2.3046, "sglang_trie_per_prompt": 3.1719, "sglang_trie_global": 3.0656}),
    ({"preset": "grpo", "scenario": "cross-sample-inflight", "max_groups": 4, "finish": "draft-server"},
     {"ours": 3.3360}),
    ({"preset": "ei", "scenario": "cross-policy", "max_groups": 4},
     {"ours": 3.3808, "ngram": 2.5186, "sglang_trie_per_prompt": 3.3045, "sglang_trie_global": 1.6218}),
    ({"preset": "humaneval", "scenario": "cold", "max_groups": 6},
     {"ours": 1.7908, "ngram": 1.6783, "sglang_trie_per_prompt": 1.7606, "sglang_trie_global": 1.6563}),
]


def measure(opts: dict) -> dict[str, float]:
    r = run_replay(ReplayOptions(progress=False, peers=PEERS, **opts))
    out = {"ours": r["ours"]["tokens_per_verify_step"]}
    out.update({k: v["tokens_per_verify_step"] for k, v in r["peers"].items() if "tokens_per_verify_step" in v})
    return {k: round(v, 4) for k, v in out.items()}


@pytest.mark.parametrize("opts, expected", [
    pytest.param(o, e, id="-".join(str(v) for v in o.values()),
                 marks=() if o["preset"] == "humaneval-sample" else pytest.mark.shared)
    for o, e in GOLDEN])
def test_tokens_per_verify_step_are_the_golden_numbers(opts, expected, request):
    if opts["preset"] != "humaneval-sample":
        request.getfixturevalue("data_root")  # the MATH logs and the full HumanEval set, beside the checkout
    got = measure(opts)
    assert {k: got[k] for k in expected} == expected


if __name__ == "__main__":  # print the current values in GOLDEN's form
    for opts, _ in GOLDEN:
        print(f"    ({opts!r},\n     {measure(opts)!r}),", file=sys.stdout)
