"""Announcing a verl step's groups to the draft server before its requests go out.

verl hands each training step's batch to its agent loop manager, which splits it among the agent
loop workers. :class:`AnnouncingAgentLoopManager` is verl's own ``AgentLoopManager`` that first
announces the batch's groups to the draft server
(:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`), so that each engine fetches the
history of the prompts routed back to it while the workers are still building their requests::

    trainer.use_v1=false
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=histospec_sgl.integrations.verl.announce.AnnouncingAgentLoopManager

with ``HISTOSPEC_DRAFT_SERVER`` in the job's environment (without it, it announces nothing). verl's
default v1 trainer dispatches through its TransferQueue manager instead, which this class does not
extend (TransferQueue is not installed where this is tested); there, engines fetch a group's history
at its first request. A
group is keyed as the engines key it: the prompt's token ids as verl's agent loops build them
(:func:`batch_groups`, verl's Continuous Token builder over ``raw_prompt`` with the data config's
chat-template arguments). Prompts that build otherwise (tools, images) are not announced, and an
announcement is only a hint: a server that is down delays a step by at most the call's timeout and
never fails it. verl gives its manager the step's batch only when the step starts, so the head start
is the workers' time to build and send their requests, not a whole step as with slime's data source.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from histospec_sgl.integrations.versions import require

require("verl")

from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

from histospec_sgl import group_key

logger = logging.getLogger("histospec_sgl.integrations")

__all__ = ["AnnouncingAgentLoopManager", "batch_groups", "token_builder"]


def token_builder(config: Any) -> Any:
    """verl's Continuous Token builder as its agent loop workers make it from the trainer config."""
    from verl.experimental.agent_loop.agent_loop import create_continuous_token_builder
    from verl.utils.config import omega_conf_to_dataclass

    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    model_type = getattr(model.hf_config, "model_type", None)
    return create_continuous_token_builder(
        model.tokenizer,
        hf_model_type=model_type if isinstance(model_type, str) else None,
        chat_template_kwargs=config.data.get("apply_chat_template_kwargs", {}),
        mm_processor_kwargs=config.data.get("mm_processor_kwargs", {}),
        processor=model.processor,
    )


def batch_groups(builder: Any, batch: Any) -> list[int]:
    """The group keys of a batch's text prompts (``raw_prompt`` chat messages), each once."""
    raw = batch.non_tensor_batch.get("raw_prompt")
    if raw is None:
        return []
    keys: set[int] = set()
    for messages in raw:
        messages = list(messages)
        if any(not isinstance(m.get("content"), str) for m in messages):
            continue  # multimodal content: built with its inputs, not announced
        keys.add(group_key(builder.build_initial_tokens(messages)))
    return sorted(keys)


class AnnouncingAgentLoopManager(AgentLoopManager):  # type: ignore[misc]
    """verl's agent loop manager, announcing each step's groups to the draft server first."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from histospec_sgl.settings import value
        from histospec_sgl.sync.client import Announcer

        address = value("HISTOSPEC_DRAFT_SERVER")
        self._announcer = Announcer(address) if address else None
        self._builder: Any = None

    @property
    def announced(self) -> int:
        """Groups announced so far."""
        return self._announcer.announced if self._announcer is not None else 0

    def _announce(self, prompts: Any) -> None:
        assert self._announcer is not None
        if self._builder is None:
            self._builder = token_builder(self.config)
        self._announcer.announce(batch_groups(self._builder, prompts), timeout=2.0)

    @auto_await  # as verl's own: the trainer calls it without awaiting
    async def generate_sequences(self, prompts: Any) -> Any:
        if self._announcer is not None and not prompts.meta_info.get("validate", False):
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._announce, prompts)
            except Exception as e:  # building the keys failed: the engines fetch at the first request
                logger.warning("histospec: keying the step's groups to announce failed: %s", e)
        return await super().generate_sequences(prompts)
