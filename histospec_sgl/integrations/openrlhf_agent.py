"""SPEC-RL for OpenRLHF 0.11: an ``AgentExecutor`` for ``--train.agent_func_path``, wrapping another.

OpenRLHF drives vLLM engines of its own (weights are broadcast to them after every step) and has no
way to pass engine options or to replace its engine actor, so HISTORY (drafting inside SGLang)
cannot run under it. What it can run is SPEC-RL through its own engines. This executor wraps an
inner one (the user's ``AgentExecutor`` file, or OpenRLHF's single-turn executor): the inner
executor runs as it would, and its first ``generate`` (the response to the prompt) reuses the
previous response of the sample's slot in its group, scored under the current policy with vLLM's
``prompt_logprobs``, cut at the first rejected token and continued with the remaining budget. The
inner executor gets one vLLM ``RequestOutput`` with the current policy's log-prob of every token;
reward, truncation and the action range are its own.

Point OpenRLHF at this file (it loads it by path and instantiates ``AgentExecutor()``)::

    --train.agent_func_path "$(python -c 'import histospec_sgl.integrations.openrlhf_agent as m; print(m.__file__)')"

and set in the Ray job's ``runtime_env.env_vars``:

- ``HISTOSPEC_DRAFT_SERVER``: the store of previous responses shared by every engine (OpenRLHF
  spreads a prompt's samples over engines by load, so a per-engine store would rarely find one);
- ``HISTOSPEC_N_SAMPLES`` (required): OpenRLHF's ``--rollout.n_samples_per_prompt`` (the executor is
  not told it): a group's n samples get n distinct slots;
- ``HISTOSPEC_INNER_AGENT_FUNC_PATH``: the executor to wrap (a file with an ``AgentExecutor``, what
  you would otherwise pass as ``--train.agent_func_path``); default OpenRLHF's single-turn executor;
- ``HISTOSPEC_REMOTE_RM_URL``: the single-turn executor's reward (a URL or a ``reward_func`` file,
  as OpenRLHF's ``--reward.remote_url``; OpenRLHF hands an agent executor none);
- ``HISTOSPEC_LENIENCE``: SPEC-RL's ℓ (1: exact); ``HISTOSPEC_SPECRL_TIMEOUT``: seconds per engine
  call (default 600).

Records are tagged with the group's round (its k-th set of n samples), the only policy version the
executor can see. Vision-language prompts go to the inner executor untouched, and so does everything
sampled with a temperature other than 1, top-p, top-k, min-p or penalties
(:func:`~histospec_sgl.specrl.guard.reuse_blocker`, the rule every trainer adapter shares: vLLM
scores prompt positions without its sampling processors; a warning says so once).
"""

from __future__ import annotations

import logging
from copy import deepcopy
from typing import Any

from histospec_sgl.integrations.versions import require

require("openrlhf")

from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor

from histospec_sgl import group_key, settings
from histospec_sgl.integrations.ray_slots import Slots
from histospec_sgl.specrl import flow
from histospec_sgl.specrl.guard import Options, note_blocked, reuse_blocker
from histospec_sgl.specrl.store import shared

_slots = Slots()
_log = logging.getLogger("histospec_sgl.integrations")
COUNTERS = ("histospec_reused", "histospec_generated", "histospec_previous_len")


def _logprob(entry: Any, token: int) -> float | None:
    lp = (entry or {}).get(token)
    return None if lp is None else float(lp.logprob)


def finished(prompt: list[int], prefix: list[int], prefix_lp: list[float], gen: Any, *, group: int, slot: int,
             round_: int) -> flow.Finished:
    """A vLLM ``CompletionOutput`` continuing the reused ``prefix`` as SPEC-RL records it: the prefix
    and the output's tokens together, with log-probs only when vLLM gave every sampled token's; the
    version is the slot's round (OpenRLHF's executor is not told its step)."""
    tokens = [int(t) for t in gen.token_ids]
    lps = [v for v in (_logprob(e, t) for e, t in zip(gen.logprobs or [], tokens)) if v is not None]
    whole = len(lps) == len(tokens)
    return flow.Finished.of(prompt, [*prefix, *tokens], [*prefix_lp, *lps] if whole else None, gen.finish_reason,
                            group=group, slot=slot, version=round_)


class _VllmBackend:
    """SpecRLRollout's backend over OpenRLHF's engine actor (``generate(ids, SamplingParams)`` ->
    vLLM ``RequestOutput``)."""

    def __init__(self, engine: Any, sampling_params: Any):
        self.engine = engine
        self.base = sampling_params

    async def __call__(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        ids = [int(t) for t in payload["input_ids"]]
        start = int(payload.get("logprob_start_len", -1))
        sp = deepcopy(self.base)
        if start >= 0:  # scoring: the sampled-token log-prob of every prompt position
            sp.max_tokens, sp.prompt_logprobs, sp.logprobs = 1, 0, None
        else:
            sp.max_tokens, sp.logprobs = int(payload["sampling_params"]["max_new_tokens"]), 0
        out = await self.engine.generate(ids, sp)
        if start >= 0:
            plp = out.prompt_logprobs or []
            entries = [[None if pos == 0 or pos >= len(plp) else _logprob(plp[pos], ids[pos]), ids[pos], None]
                       for pos in range(start, len(ids))]
            return {"output_ids": [], "meta_info": {"input_token_logprobs": entries,
                                                    "finish_reason": {"type": "length"}}}
        gen = out.outputs[0]
        tokens = [int(t) for t in gen.token_ids]
        lps = [_logprob(e, t) for e, t in zip(gen.logprobs or [], tokens)]
        if len(lps) != len(tokens) or any(v is None for v in lps):
            raise ValueError(f"vLLM returned {len(lps)} sampled-token log-probs for {len(tokens)} tokens")
        return {"output_ids": tokens, "meta_info": {"output_token_logprobs": [[v, t, None] for v, t in zip(lps, tokens)],
                                                    "finish_reason": {"type": gen.finish_reason or "length"}}}


class _ReusingEngine:
    """The engine the inner executor sees: its first ``generate`` (the response to the prompt) reuses
    the slot's previous response, scored and cut under the current policy, and continues it on the
    real engine; the answer is one vLLM ``RequestOutput`` as if the engine had generated it all, with
    the current policy's log-prob of every token. Later calls (a multi-turn executor's) pass through."""

    def __init__(self, engine: Any, options: Options, n: int):
        self._engine = engine
        self.options = options
        self.n = n
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._used = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        if self._used:
            return await self._engine.generate(prompt_token_ids, sampling_params, *args, **kwargs)
        self._used = True
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        prompt = [int(t) for t in prompt_token_ids]
        group = group_key(prompt)
        slot, round_ = await _slots.slot_and_round(group, self.n)
        previous = shared().get(self.options.draft_server, group, slot)
        max_tokens = int(sampling_params.max_tokens)
        reuse = None
        if previous is not None and previous.response_ids:
            self.counters["histospec_previous_len"] = float(len(previous.response_ids))
            reuse = await flow.reuse(_VllmBackend(self._engine, sampling_params), self.options, group=group, slot=slot,
                                     round_=round_, prompt_ids=prompt, sampling_params={"max_new_tokens": max_tokens},
                                     previous=previous)
            if reuse.aborted:
                reuse = None
        prefix = reuse.prefix if reuse is not None else []
        prefix_lp = reuse.logprobs if reuse is not None else []
        if reuse is not None and reuse.done:
            out = RequestOutput(request_id=f"histospec-{group:016x}-{slot}-{round_}", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                                outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                                          logprobs=[], finish_reason=reuse.finish_reason)],
                                finished=True)
        else:
            # The sampled token's log-prob is asked for either way: the response is recorded with it.
            sp = deepcopy(sampling_params)
            sp.logprobs = 0 if sp.logprobs is None else sp.logprobs
            if reuse is not None:
                sp.max_tokens = reuse.max_new_tokens
            out = await self._engine.generate(prompt + prefix, sp, *args, **kwargs)
        gen = out.outputs[0]
        tokens = [int(t) for t in gen.token_ids]
        self.counters.update(histospec_reused=float(len(prefix)), histospec_generated=float(len(tokens)))
        ids = prefix + tokens
        flow.record(self.options.draft_server, finished(prompt, prefix, prefix_lp, gen, group=group, slot=slot,
                                                        round_=round_))
        gen.token_ids = ids
        if sampling_params.logprobs is None:
            gen.logprobs = None
        else:
            gen.logprobs = [{t: Logprob(logprob=v)} for t, v in zip(prefix, prefix_lp)] + list(gen.logprobs or [])
        out.prompt_token_ids = prompt
        return out


def _inner_executor() -> Any:
    """The executor SPEC-RL wraps: ``HISTOSPEC_INNER_AGENT_FUNC_PATH`` (a file with an
    ``AgentExecutor`` class, as ``--train.agent_func_path`` takes) or OpenRLHF's single-turn executor
    with the reward from ``HISTOSPEC_REMOTE_RM_URL``."""
    path = settings.value("HISTOSPEC_INNER_AGENT_FUNC_PATH")
    if path:
        from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

        inner = _load_agent_executor(path)
        if isinstance(inner, AgentExecutor):
            raise ValueError("HISTOSPEC_INNER_AGENT_FUNC_PATH names histospec's own executor")
        return inner
    urls = settings.value("HISTOSPEC_REMOTE_RM_URL")
    return SingleTurnAgentExecutor(list(urls) if urls else None)


class AgentExecutor(AgentExecutorBase):
    def __init__(self) -> None:
        n = settings.value("HISTOSPEC_N_SAMPLES")
        if n is None:
            # Without it a group's samples would share one previous response and stop being
            # independent draws: refuse at engine start-up rather than train on them.
            raise ValueError("HISTOSPEC_N_SAMPLES is not set: set it in the Ray job's runtime_env.env_vars to "
                             "OpenRLHF's --rollout.n_samples_per_prompt (the executor is not told the group size)")
        self.n = n
        self.options = Options.resolve()
        self.inner = _inner_executor()

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        blocker = "images" if images else reuse_blocker(sampling_params)
        if blocker is not None:
            note_blocked(blocker, "OpenRLHF")
            output = await self.inner.execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                                              images)
            counters = dict.fromkeys(COUNTERS, 0.0)
            ranges = output.get("action_ranges") or []
            counters["histospec_generated"] = float(sum(b - a for a, b in ranges))
        else:
            engine = _ReusingEngine(llm_engine, self.options, self.n)
            output = await self.inner.execute(prompt, label, sampling_params, max_length, hf_tokenizer, engine, images)
            counters = engine.counters
        output["extra_logs"] = {**(output.get("extra_logs") or {}), **counters}
        return output
