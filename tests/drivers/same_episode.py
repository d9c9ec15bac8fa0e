"""One SPEC-RL episode in each trainer's own types (slime's ``Sample``, verl's ``TokenOutput``, vLLM's
``CompletionOutput`` under OpenRLHF), translated by each adapter and recorded by the one flow; prints
what each adapter recorded, as JSON, for tests/trainers/test_same_episode.py to compare. Runs in
.venv-sglang with slime's source on ``sys.path`` (argv[1])."""

from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

sys.path.insert(0, sys.argv[1])

from slime.utils.types import Sample  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput  # noqa: E402

from histospec_sgl import group_key  # noqa: E402
from histospec_sgl.integrations import openrlhf_agent, slime  # noqa: E402
from histospec_sgl.integrations.verl import agent_loop  # noqa: E402
from histospec_sgl.specrl import flow, store  # noqa: E402

PROMPT = [11, 12, 13, 14]
GROUP = group_key(PROMPT)
N, SLOT, VERSION = 4, 1, 3
#: The reused prefix (scored under the current policy) and what the engine generated after it.
PREFIX, PREFIX_LP = [21, 22], [-0.1, -0.2]
#: Each episode: the generated tokens, their log-probs (None: the engine gave one token none), and
#: how it ended, in SGLang's words; the trainers' own words for it follow.
EPISODES = {
    "truncated": ([23, 24, 25], [-0.3, -0.4, -0.5], "length"),
    "finished": ([23, 2], [-0.3, -0.6], "stop"),
    "aborted": ([23], [-0.3], "abort"),
    "a log-prob missing": ([23, 24], [-0.3, None], "stop"),
}
SLIME_STATUS = {"length": Sample.Status.TRUNCATED, "stop": Sample.Status.COMPLETED, "abort": Sample.Status.ABORTED}
#: verl's rollout servers: SGLang's says "abort", vLLM's "aborted".
VERL_REASON = {"length": "length", "stop": "stop", "abort": "aborted"}


def via_slime(tokens: list[int], lps: list[float | None], reason: str) -> flow.Finished | None:
    args = SimpleNamespace(n_samples_per_prompt=N, reward_key=None)
    sample = Sample(index=2 * N + SLOT, prompt="What is 2 + 2?", tokens=[*PROMPT, *PREFIX, *tokens],
                    response_length=len(PREFIX) + len(tokens), status=SLIME_STATUS[reason],
                    rollout_log_probs=None if None in lps else [*PREFIX_LP, *lps], weight_versions=[str(VERSION)],
                    metadata={"histospec_group": GROUP})
    return slime.finished(args, sample)


def via_verl(tokens: list[int], lps: list[float | None], reason: str) -> flow.Finished:
    out = TokenOutput(token_ids=tokens, log_probs=None if None in lps else lps, stop_reason=VERL_REASON[reason],
                      extra_fields={"global_steps": VERSION})
    return agent_loop.finished(PROMPT, PREFIX, PREFIX_LP, out, group=GROUP, slot=SLOT)


def via_openrlhf(tokens: list[int], lps: list[float | None], reason: str) -> flow.Finished:
    gen = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                           logprobs=[{t: Logprob(logprob=v)} if v is not None else {} for t, v in zip(tokens, lps)],
                           finish_reason=reason)
    return openrlhf_agent.finished(PROMPT, PREFIX, PREFIX_LP, gen, group=GROUP, slot=SLOT, round_=VERSION)


def main() -> None:
    out: dict[str, dict[str, object]] = {}
    for name, (tokens, lps, reason) in EPISODES.items():
        for trainer, translate in (("slime", via_slime), ("verl", via_verl), ("openrlhf", via_openrlhf)):
            store._SHARED = None  # each adapter records into a store of its own
            done = translate(tokens, lps, reason)
            assert done is not None, (name, trainer)
            kept = flow.record(None, done)
            prev = store.shared().get(None, GROUP, SLOT)
            out.setdefault(name, {})[trainer] = {
                "finished": dataclasses.asdict(done), "recorded": kept,
                "previous": None if prev is None else dataclasses.asdict(prev)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
