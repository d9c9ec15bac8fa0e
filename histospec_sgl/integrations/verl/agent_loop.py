"""SPEC-RL as a verl agent loop: ``histospec_specrl``, wrapping another agent loop.

The inner agent loop (``inner_agent_loop``, default verl's ``single_turn_agent``; any registered
one) runs as it would, with one change: the first ``generate`` it makes (the response to the prompt)
reuses the previous response of the sample's slot in its group (:mod:`histospec_sgl.integrations.
ray_slots`). That response is scored under the current policy through verl's own server manager
(vLLM-style ``prompt_logprobs``, which verl's SGLang and vLLM servers both answer), cut at the first
rejected token (:meth:`~histospec_sgl.specrl.client.SpecRLRollout.reuse`) and continued from there
with the remaining budget (same request id: same server, the scored prefix in its radix cache). The
inner loop gets one ``TokenOutput`` with the current policy's log-prob of every token, and the
response is published to the draft server with its log-probs, slot and verl's ``global_steps`` as
the policy version: the previous responses of the next epoch, whichever worker or server handles
them. Requests SPEC-RL cannot score exactly (verl's validation at its greedy ``val_kwargs``, any
temperature other than 1, top-p, top-k; :func:`~histospec_sgl.specrl.guard.reuse_blocker`, shared by
every trainer adapter) run the inner loop untouched.

Use it with::

    actor_rollout_ref.rollout.agent.default_agent_loop=histospec_specrl
    actor_rollout_ref.rollout.agent.agent_loop_config_path=<examples/verl/agent_loops.yaml>

and ``HISTOSPEC_DRAFT_SERVER`` in the Ray job's ``runtime_env.env_vars`` (without it each agent loop
worker keeps its own store, which only helps when a prompt's samples return to the same worker).
Arguments from the agent-loop YAML entry: ``inner_agent_loop``, ``lenience`` (ℓ >= 1, default
``HISTOSPEC_LENIENCE`` or 1), ``timeout`` (seconds per engine call, default
``HISTOSPEC_SPECRL_TIMEOUT`` or 600), ``draft_server`` (default ``HISTOSPEC_DRAFT_SERVER``),
``seed``. Each sample's ``histospec_reused``, ``histospec_generated``, ``histospec_previous_len`` and
``histospec_slot`` reach the batch's non-tensor fields.
"""

from __future__ import annotations

import logging
from typing import Any

from histospec_sgl.integrations.versions import require

require("verl")

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.workers.rollout.replica import TokenOutput

from histospec_sgl import group_key
from histospec_sgl.integrations.ray_slots import Slots
from histospec_sgl.integrations.verl.router import request_id_for
from histospec_sgl.specrl import flow
from histospec_sgl.specrl.client import SpecRLRequestError
from histospec_sgl.specrl.guard import Options, note_blocked, reuse_blocker
from histospec_sgl.specrl.store import shared

_slots = Slots()
_log = logging.getLogger("histospec_sgl.integrations")


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


#: verl's names for a request that did not finish (its vLLM server says "aborted"), as SGLang's.
_ABORTED = {"aborted": "abort"}


def finished(prompt_ids: list[int], prefix: list[int], prefix_lp: list[float], out: TokenOutput, *, group: int,
             slot: int) -> flow.Finished:
    """A verl ``TokenOutput`` continuing the reused ``prefix`` as SPEC-RL records it: the prefix and
    the output's tokens together, the version verl's ``global_steps``."""
    lps = None if out.log_probs is None else [*prefix_lp, *out.log_probs]
    return flow.Finished.of(prompt_ids, [*prefix, *out.token_ids], lps, _ABORTED.get(out.stop_reason or "", out.stop_reason),
                            group=group, slot=slot, version=int((out.extra_fields or {}).get("global_steps") or 0))


def _counters(*, slot: int = -1, generated: int = 0) -> dict[str, int]:
    """A sample's SPEC-RL fields with nothing reused (slot -1: none taken)."""
    return {"histospec_reused": 0, "histospec_generated": generated, "histospec_previous_len": 0,
            "histospec_slot": slot}


class _ReusingServerManager:
    """The server manager an inner agent loop sees: its first ``generate`` (the response to the
    prompt) reuses the slot's previous response, scored and cut under the current policy, and
    continues it through verl's server manager; the answer is one ``TokenOutput`` as if the engine
    had generated it all, with the current policy's log-prob of every token. Every other call
    (later turns of a multi-turn loop) passes through."""

    def __init__(self, inner: Any, options: Options, n: int, response_length: int):
        self._inner = inner
        self.options = options
        self.n = n
        self.response_length = response_length
        self.first: dict[str, Any] | None = None  # the counters of the first call, once made

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        if self.first is not None:
            return await self._inner.generate(request_id=request_id, prompt_ids=prompt_ids,
                                              sampling_params=sampling_params, **kwargs)
        prompt_ids = [int(t) for t in prompt_ids]
        group = group_key(prompt_ids)
        slot, round_ = await _slots.slot_and_round(group, self.n)
        self.first = _counters(slot=slot)
        # The group in the request id keeps scoring and continuation with the prompt's server under
        # the prompt-affinity balancer; any other balancer keys on the id as a sticky session.
        rid = request_id_for(group, request_id)
        previous = shared().get(self.options.draft_server, group, slot)
        media = any(kwargs.get(k) is not None for k in ("image_data", "video_data", "audio_data"))
        reuse = None
        if previous is not None and previous.response_ids and not media:
            backend = _VerlBackend(self._inner, rid, sampling_params)
            self.first["histospec_previous_len"] = len(previous.response_ids)
            try:
                reuse = await flow.reuse(backend, self.options, group=group, slot=slot, round_=round_,
                                         prompt_ids=prompt_ids, previous=previous,
                                         sampling_params={**sampling_params, "max_new_tokens": self.response_length})
            except SpecRLRequestError as e:
                # verl's server raises on an aborted scoring prefill (its prompt log-prob check):
                # generate normally, and the answer is verl's own (aborted or not).
                _log.warning("histospec (verl): %s; generating normally", e)
            if reuse is not None and reuse.aborted:
                reuse = None
        wants_logprobs = bool(sampling_params.get("logprobs"))
        # Log-probs are asked for either way: the response is recorded with them for the next epoch.
        if reuse is None:
            prefix, prefix_lp = [], []
            out = await self._inner.generate(request_id=rid, prompt_ids=prompt_ids,
                                             sampling_params={**sampling_params, "logprobs": True}, **kwargs)
        elif reuse.done:
            prefix, prefix_lp = reuse.prefix, reuse.logprobs
            out = TokenOutput(token_ids=[], log_probs=[], stop_reason=reuse.finish_reason,
                              extra_fields=dict(backend.extra_fields))
        else:
            prefix, prefix_lp = reuse.prefix, reuse.logprobs
            out = await self._inner.generate(request_id=rid, prompt_ids=prompt_ids + prefix,
                                             sampling_params={**sampling_params, "max_tokens": reuse.max_new_tokens,
                                                              "logprobs": True}, **kwargs)
        extra = dict(out.extra_fields or {})
        if reuse is not None:
            for key in ("prompt_ids", "prompt_logprobs"):  # the scoring pass's, not the caller's
                extra.pop(key, None)
        ids = prefix + [int(t) for t in out.token_ids]
        lps = prefix_lp + [float(x) for x in out.log_probs] if out.log_probs is not None else None
        self.first.update(histospec_reused=len(prefix), histospec_generated=len(out.token_ids))
        flow.record(self.options.draft_server, finished(prompt_ids, prefix, prefix_lp, out, group=group, slot=slot))
        extra.update(self.first)
        return TokenOutput(token_ids=ids, log_probs=lps if wants_logprobs else None, routed_experts=out.routed_experts, stop_reason=out.stop_reason,
                           num_preempted=out.num_preempted, extra_fields=extra)


@register("histospec_specrl")
class SpecRLAgentLoop(AgentLoopBase):
    """SPEC-RL around another agent loop (``inner_agent_loop``, default verl's ``single_turn_agent``):
    the inner loop runs as it would, with a server manager whose first generate reuses the previous
    response (:class:`_ReusingServerManager`). Requests SPEC-RL cannot score exactly (validation at
    verl's greedy ``val_kwargs``, temperature other than 1, top-p/top-k: :func:`~histospec_sgl.specrl.
    guard.reuse_blocker`) run the inner loop untouched."""

    def __init__(self, *args: Any, lenience: float | None = None, draft_server: str | None = None,
                 seed: int = 0, timeout: float | None = None, inner_agent_loop: str = "single_turn_agent",
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        if args:
            raise TypeError("verl instantiates agent loops with keyword arguments only")
        if inner_agent_loop == "histospec_specrl":
            raise ValueError("inner_agent_loop cannot be histospec_specrl itself")
        self.options = Options.resolve(lenience=lenience, timeout=timeout, seed=seed, draft_server=draft_server)
        self.inner_agent_loop = inner_agent_loop
        self._kwargs = kwargs

    def _inner(self, server_manager: Any) -> AgentLoopBase:
        import hydra
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

        if self.inner_agent_loop not in _agent_loop_registry:
            raise ValueError(f"inner_agent_loop {self.inner_agent_loop!r} is not a registered agent loop "
                             f"({', '.join(sorted(_agent_loop_registry))})")
        return hydra.utils.instantiate(config=_agent_loop_registry[self.inner_agent_loop],
                                       **{**self._kwargs, "server_manager": server_manager})

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        blocker = reuse_blocker(sampling_params)
        if blocker is None and self.rollout_config.get("enable_rollout_routing_replay", False):
            blocker = "enable_rollout_routing_replay"  # a reused prefix has no routed experts
        if blocker is not None:
            note_blocked(blocker, "verl")
            out = await self._inner(self.server_manager).run(sampling_params, **kwargs)
            out.extra_fields.update(_counters(generated=len(out.response_ids)))
            return out
        proxy = _ReusingServerManager(self.server_manager, self.options, int(self.rollout_config.n),
                                      int(self.rollout_config.response_length))
        out = await self._inner(proxy).run(sampling_params, **kwargs)
        out.extra_fields.update(proxy.first or _counters())
        return out
