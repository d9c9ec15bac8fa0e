"""SPEC-RL for OpenRLHF 0.11: an ``AgentExecutor`` for ``--train.agent_func_path``.

OpenRLHF drives vLLM engines of its own (weights are broadcast to them after every step) and has no
way to pass engine options or to replace its engine actor, so HISTORY (drafting inside SGLang)
cannot run under it. What it can run is SPEC-RL through its own engines: this executor reuses the
previous response of the sample's slot in its group, scores it under the current policy with vLLM's
``prompt_logprobs``, cuts at the first rejected token, continues with the remaining budget, and
returns what OpenRLHF's single-turn executor returns (observation tokens, the action range, the
current policy's log-probs, the reward from the same reward function or server).

Point OpenRLHF at this file (it loads it by path and instantiates ``AgentExecutor()``)::

    --train.agent_func_path "$(python -c 'import histospec_sgl.integrations.openrlhf_agent as m; print(m.__file__)')"

and set in the Ray job's ``runtime_env.env_vars``:

- ``HISTOSPEC_DRAFT_SERVER``: the store of previous responses shared by every engine (OpenRLHF
  spreads a prompt's samples over engines by load, so a per-engine store would rarely find one);
- ``HISTOSPEC_N_SAMPLES`` (required): OpenRLHF's ``--rollout.n_samples_per_prompt`` (the executor is
  not told it): a group's n samples get n distinct slots;
- ``HISTOSPEC_REMOTE_RM_URL``: the reward (a URL or a ``reward_func`` file, as OpenRLHF's
  ``--reward.remote_url``; OpenRLHF hands an agent executor none);
- ``HISTOSPEC_LENIENCE``: SPEC-RL's ℓ (1: exact).

Records are tagged with the group's round (its k-th set of n samples), the only policy version the
executor can see. Vision-language prompts are generated normally, and so is everything sampled with
a temperature other than 1, top-p, top-k, min-p or penalties: vLLM scores prompt positions without
its sampling processors, so the scored log-probs would not be those of the sampling distribution
(a warning says so once).
"""

from __future__ import annotations

import logging
import os
from copy import deepcopy
from typing import Any

import numpy as np

from histospec_sgl.integrations.versions import require

require("openrlhf")

from openrlhf.utils.agent import SingleTurnAgentExecutor

from histospec_sgl import prompt_key
from histospec_sgl.integrations.previous import shared
from histospec_sgl.integrations.ray_slots import Slots
from histospec_sgl.specrl.acceptance import check_lenience
from histospec_sgl.specrl.client import RolloutRequest, SpecRLRollout

_slots = Slots()
_log = logging.getLogger("histospec_sgl.integrations")
_warned: set[str] = set()


def _reuse_blocker(sp: Any) -> str | None:
    """Why SPEC-RL cannot reuse under these vLLM sampling parameters, or None. vLLM scores prompt
    positions without its sampling processors, so the scored log-probs describe the sampling
    distribution only under plain sampling; the acceptance test would otherwise compare two
    different distributions."""
    checks = [("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
              ("presence_penalty", 0.0), ("frequency_penalty", 0.0)]
    for name, plain in checks:
        v = getattr(sp, name, plain)
        if v is not None and abs(float(v) - plain) > 1e-9:
            return f"{name}={v}"
    top_k = getattr(sp, "top_k", None)
    if top_k not in (None, 0, -1):
        return f"top_k={top_k}"
    return None


def _logprob(entry: Any, token: int) -> float | None:
    lp = (entry or {}).get(token)
    return None if lp is None else float(lp.logprob)


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


class AgentExecutor(SingleTurnAgentExecutor):
    def __init__(self) -> None:
        urls = [u.strip() for u in os.environ.get("HISTOSPEC_REMOTE_RM_URL", "").split(",") if u.strip()]
        super().__init__(urls or None)
        self.lenience = check_lenience(float(os.environ.get("HISTOSPEC_LENIENCE") or 1.0))
        n = os.environ.get("HISTOSPEC_N_SAMPLES", "").strip()
        if not n.isdigit() or int(n) < 1:
            # Without it a group's samples would share one previous response and stop being
            # independent draws: refuse at engine start-up rather than train on them.
            raise ValueError(f"HISTOSPEC_N_SAMPLES={n!r}: set it in the Ray job's runtime_env.env_vars to "
                             "OpenRLHF's --rollout.n_samples_per_prompt (the executor is not told the group size)")
        self.n = int(n)
        self.draft_server = os.environ.get("HISTOSPEC_DRAFT_SERVER") or None

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        if images:
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
        prompt_ids = hf_tokenizer(text=prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
        max_tokens = sampling_params.max_tokens or max(1, max_length - len(prompt_ids))
        if len(prompt_ids) > max_length - max_tokens:
            prompt_ids = prompt_ids[-(max_length - max_tokens):]
        group = prompt_key(prompt_ids)
        k = await _slots.take(group, 1 << 62)  # the k-th sample of this group: round k // n, slot k % n
        slot, round_ = k % self.n, k // self.n
        blocker = _reuse_blocker(sampling_params)
        previous = None if blocker else shared().get(self.draft_server, group, slot)
        if blocker and blocker not in _warned:
            _warned.add(blocker)
            _log.warning("histospec: SPEC-RL reuses nothing with %s (vLLM scores prompt positions without its "
                         "sampling processors); generating normally", blocker)
        rng = np.random.default_rng(np.random.SeedSequence([group & 0xFFFFFFFF, group >> 32, k]))
        client = SpecRLRollout(_VllmBackend(llm_engine, sampling_params), lenience=self.lenience, rng=rng,
                               concurrency=1)
        (res,) = await client.rollout([RolloutRequest(prompt_ids, {"max_new_tokens": max_tokens}, previous,
                                                      group=group, sample_index=slot)])
        observation = prompt_ids + res.response_ids
        output = {
            "prompt": prompt, "label": label, "images": images, "mm_train_inputs": None,
            "observation_tokens": observation,
            "action_ranges": [(len(prompt_ids), len(observation))],
            "rollout_log_probs": ([0.0] * len(prompt_ids) + res.logprobs) if sampling_params.logprobs is not None
            else None,
            "truncated": res.finish_reason == "length",
            "reward": None, "scores": None, "extra_logs": {},
        }
        await self._score(output, hf_tokenizer, prompt, label)
        output["extra_logs"] = {**output["extra_logs"], "histospec_reused": float(res.reused),
                                "histospec_generated": float(res.generated),
                                "histospec_previous_len": float(res.previous_len)}
        # Queued for the draft server in the background: never waits on it, never fails for it.
        shared().record(self.draft_server, prompt_ids, res.response_ids, res.logprobs,
                        res.finish_reason, group=group, slot=slot, version=round_)
        return output

    async def _score(self, output: dict[str, Any], hf_tokenizer: Any, prompt: Any, label: Any) -> None:
        """The reward, as OpenRLHF's single-turn executor computes it (a reward_func file or servers)."""
        if not self.reward_endpoints:
            return
        query = hf_tokenizer.decode(output["observation_tokens"], skip_special_tokens=False)
        try:
            if self.reward_func:
                infos = await self._fetch_rewards_via_func([query], [prompt], [label])
            else:
                infos = await self._fetch_rewards_via_http([query], [prompt], [label])
        except Exception as e:  # as OpenRLHF's own executor: the sample goes on without a reward
            _log.warning("histospec: the reward failed: %s", e)
            return
        info = infos[0] if infos else None
        if isinstance(info, list):  # reward_func answers a batch
            info = info[0] if info else None
        if info:
            reward = _scalar(info.get("rewards"))
            score = _scalar(info.get("scores"))
            output.update(reward=reward, scores=reward if score is None else score,
                          extra_logs=info.get("extra_logs") or {})


def _scalar(v: Any) -> Any:
    """A one-element tensor or list (a batch of one) as a float; anything else unchanged."""
    if hasattr(v, "numel") and v.numel() == 1:
        return float(v.reshape(-1)[0])
    if isinstance(v, (list, tuple)) and len(v) == 1:
        return float(v[0])
    return v
