"""SPEC-RL as a verl agent loop: ``histospec_specrl``.

Each sample reuses the previous response of its slot in its group (:mod:`histospec_sgl.integrations.
ray_slots`), scored under the current policy through verl's own server manager (vLLM-style
``prompt_logprobs``, which verl's SGLang and vLLM servers both answer), cut at the first rejected
token and continued from there with the remaining budget (same request id: same server, the scored
prefix in its radix cache). The result is what verl's single-turn loop returns (Continuous Token
prompt and merge), with the current policy's log-prob of every response token, and it is published
to the draft server with its log-probs, slot and verl's ``global_steps`` as the policy version: the
previous responses of the next epoch, whichever worker or server handles them.

Use it with::

    actor_rollout_ref.rollout.agent.default_agent_loop=histospec_specrl
    actor_rollout_ref.rollout.agent.agent_loop_config_path=<examples/verl/agent_loops.yaml>
    actor_rollout_ref.rollout.calculate_log_probs=True

and ``HISTOSPEC_DRAFT_SERVER`` in the Ray job's ``runtime_env.env_vars`` (without it each agent loop
worker keeps its own store, which only helps when a prompt's samples return to the same worker).
Arguments from the agent-loop YAML entry: ``lenience`` (ℓ >= 1, default ``HISTOSPEC_LENIENCE`` or
1), ``draft_server`` (default ``HISTOSPEC_DRAFT_SERVER``), ``seed``.
"""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

import numpy as np

from histospec_sgl.integrations.versions import require

require("verl")

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.workers.rollout.replica import TokenOutput

from histospec_sgl import prompt_key
from histospec_sgl.integrations.previous import shared
from histospec_sgl.integrations.ray_slots import Slots
from histospec_sgl.integrations.verl.router import request_id_for
from histospec_sgl.specrl.acceptance import check_lenience
from histospec_sgl.specrl.client import RolloutRequest, SpecRLRollout

_slots = Slots()


def _input_logprobs(out: TokenOutput, input_ids: list[int], start: int) -> list[list[Any]]:
    """verl's ``prompt_logprobs`` rows (row k: the token at position k + 1, then a padding row) as
    SGLang's ``input_token_logprobs`` from position ``start``."""
    ids, lps = out.extra_fields.get("prompt_ids"), out.extra_fields.get("prompt_logprobs")
    if ids is None or lps is None:
        raise ValueError("the server returned no prompt_logprobs (is it verl >= 0.9 with SGLang or vLLM?)")
    entries: list[list[Any]] = []
    for pos in range(max(0, start), len(input_ids)):
        if pos == 0:
            entries.append([None, int(input_ids[0]), None])
        else:
            entries.append([float(lps[pos - 1][0]), int(ids[pos - 1][0]), None])
    return entries


class _VerlBackend:
    """SpecRLRollout's backend over verl's server manager; keeps the last answer's extra fields."""

    def __init__(self, server_manager: Any, request_id: str, sampling_params: dict[str, Any]):
        self.server_manager = server_manager
        self.request_id = request_id
        self.base = {k: v for k, v in sampling_params.items() if k not in ("logprobs", "max_tokens", "max_new_tokens")}
        self.extra_fields: dict[str, Any] = {}

    async def __call__(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        input_ids = [int(t) for t in payload["input_ids"]]
        max_new = int(payload["sampling_params"].get("max_new_tokens", 1))
        start = int(payload.get("logprob_start_len", -1))
        if start >= 0:  # scoring
            sp = {**self.base, "max_tokens": 1, "prompt_logprobs": 0}
        else:
            sp = {**self.base, "max_tokens": max_new, "logprobs": True}
        out: TokenOutput = await self.server_manager.generate(request_id=self.request_id, prompt_ids=input_ids,
                                                              sampling_params=sp)
        self.extra_fields = dict(out.extra_fields or {})
        meta: dict[str, Any] = {"finish_reason": {"type": out.stop_reason or "length"}}
        if start >= 0:
            meta["input_token_logprobs"] = _input_logprobs(out, input_ids, start)
            return {"output_ids": list(out.token_ids), "meta_info": meta}
        ids = [int(t) for t in out.token_ids]
        if out.log_probs is None or len(out.log_probs) != len(ids):
            raise ValueError(f"{len(ids)} tokens came back with {0 if out.log_probs is None else len(out.log_probs)} "
                             "log-probs")
        meta["output_token_logprobs"] = [[float(lp), t, None] for lp, t in zip(out.log_probs, ids)]
        return {"output_ids": ids, "meta_info": meta}


@register("histospec_specrl")
class SpecRLAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, lenience: float | None = None, draft_server: str | None = None,
                 seed: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length
        self.lenience = check_lenience(float(lenience or os.environ.get("HISTOSPEC_LENIENCE") or 1.0))
        self.draft_server = draft_server or os.environ.get("HISTOSPEC_DRAFT_SERVER") or None
        self.seed = int(seed)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = [int(t) for t in await self.ct_build_initial_tokens(messages)]
        group = prompt_key(prompt_ids)
        slot = await _slots.take(group, int(self.rollout_config.n))
        previous = shared().get(self.draft_server, group, slot)
        # The group in the request id keeps scoring and continuation with the prompt's server under
        # the prompt-affinity balancer; any other balancer keys on the id as a sticky session.
        backend = _VerlBackend(self.server_manager, request_id_for(group, uuid4().hex), sampling_params)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, group & 0xFFFFFFFF, group >> 32, slot,
                                                            int(uuid4().int & 0xFFFFFFFF)]))
        client = SpecRLRollout(backend, lenience=self.lenience, rng=rng, concurrency=1)
        params = {**sampling_params, "max_new_tokens": self.response_length}
        (res,) = await client.rollout([RolloutRequest(prompt_ids, params, previous, group=group, sample_index=slot)])

        merge, response_mask, response_logprobs = await self.ct_merge_assistant_token(
            prompt_ids, res.response_ids, [], [], assistant_logprobs=res.logprobs)
        response_ids = merge.token_ids[-len(response_mask):] if response_mask else []
        prompt_ids_out = merge.token_ids[: len(merge.token_ids) - len(response_mask)]
        version = int(backend.extra_fields.get("global_steps") or 0)
        # Queued for the draft server in the background: never waits on it, never fails for it.
        shared().record(self.draft_server, prompt_ids, res.response_ids, res.logprobs,
                        res.finish_reason, group=group, slot=slot, version=version)
        extra = dict(backend.extra_fields)
        extra.update({"turn_scores": [], "tool_rewards": [], "histospec_reused": res.reused,
                      "histospec_generated": res.generated, "histospec_previous_len": res.previous_len,
                      "histospec_slot": slot})
        return AgentLoopOutput(
            prompt_ids=prompt_ids_out,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
            num_turns=2,
            metrics={"num_preempted": -1},
            extra_fields=extra,
        )
