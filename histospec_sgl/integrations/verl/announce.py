"""Announcing a verl step's groups to the draft server before its requests go out.

verl hands each training step's batch to its agent loop manager, which splits it among the agent
loop workers. :class:`AnnouncingAgentLoopManager` is verl's own ``AgentLoopManager`` that first
announces the batch's groups to the draft server
(:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`), so that each engine fetches the
history of the prompts routed back to it while the workers are still building their requests::

    trainer.use_v1=false
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=histospec_sgl.integrations.verl.announce.AnnouncingAgentLoopManager

with ``HISTOSPEC_DRAFT_SERVER`` (or ``HISTOSPEC_DRAFT_SERVER_ACTOR``) in the job's environment
(without either, it announces nothing). verl's
default v1 trainer dispatches through its TransferQueue manager instead; there the same announcement
is :class:`AnnouncingAgentLoopManagerTQ` (verl's ``AgentLoopManagerTQ``, built only when verl asks for
it by path, since importing it needs TransferQueue)::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=histospec_sgl.integrations.verl.announce.AnnouncingAgentLoopManagerTQ

A group is keyed as the engines key it: the prompt's token ids as verl's agent loops build them
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

__all__ = ["AnnouncingAgentLoopManager", "AnnouncingAgentLoopManagerTQ", "batch_groups", "token_builder"]  # noqa: F822 (the TQ one: module __getattr__)


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
    """The group keys of a batch's text prompts (``raw_prompt`` chat messages), each once. The batch
    is the legacy trainer's ``DataProto`` or the v1 trainer's ``TensorDict``."""
    if hasattr(batch, "non_tensor_batch"):
        raw = batch.non_tensor_batch.get("raw_prompt")
    else:
        raw = batch["raw_prompt"] if "raw_prompt" in batch.keys() else None  # the lists, not the stack
    if raw is None:
        return []
    keys: set[int] = set()
    for messages in raw:
        messages = list(messages)
        if any(not isinstance(m.get("content"), str) for m in messages):
            continue  # multimodal content: built with its inputs, not announced
        keys.add(group_key(builder.build_initial_tokens(messages)))
    return sorted(keys)


def _validating(batch: Any) -> bool:
    if hasattr(batch, "meta_info"):
        return bool(batch.meta_info.get("validate", False))
    if "validate" not in batch.keys():
        return False
    flag = batch.get("validate")
    return bool(getattr(flag, "data", flag))


class _Announcing:
    """What both managers add to verl's: the announcer, made from ``HISTOSPEC_DRAFT_SERVER``, and the
    announcement of a training batch's groups, which never fails the step."""

    config: Any

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)  # verl's manager
        from histospec_sgl.specrl.guard import Options
        from histospec_sgl.sync.client import Announcer

        # HISTOSPEC_DRAFT_SERVER, or the draft-server actor's address inside a Ray job, as the
        # SPEC-RL agent loop reads it.
        address = Options.resolve().draft_server
        self._announcer = Announcer(address) if address else None
        self._builder: Any = None

    @property
    def announced(self) -> int:
        """Groups announced so far."""
        return self._announcer.announced if self._announcer is not None else 0

    def _announce(self, prompts: Any) -> None:
        if self._announcer is None or _validating(prompts):
            return
        try:
            if self._builder is None:
                self._builder = token_builder(self.config)
            groups = batch_groups(self._builder, prompts)
        except Exception as e:  # building the keys failed: the engines fetch at the first request
            logger.warning("histospec: keying the step's groups to announce failed: %s", e)
            return
        self._announcer.announce(groups, timeout=2.0)


class AnnouncingAgentLoopManager(_Announcing, AgentLoopManager):  # type: ignore[misc]
    """verl's agent loop manager, announcing each step's groups to the draft server first."""

    @auto_await  # as verl's own: the trainer calls it without awaiting
    async def generate_sequences(self, prompts: Any) -> Any:
        await asyncio.get_running_loop().run_in_executor(None, self._announce, prompts)
        return await super().generate_sequences(prompts)


def __getattr__(name: str) -> Any:
    # verl's TransferQueue manager is imported only when verl asks for this one by path: importing
    # it needs TransferQueue, which the legacy trainer does not.
    if name == "AnnouncingAgentLoopManagerTQ":
        cls = _announcing_tq_manager()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _announcing_tq_manager() -> type:
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    class AnnouncingAgentLoopManagerTQ(_Announcing, AgentLoopManagerTQ):  # type: ignore[misc]
        """verl's TransferQueue agent loop manager (the v1 trainer's), announcing each step's groups
        to the draft server before it dispatches them."""

        def generate_sequences(self, prompts: Any) -> None:
            self._announce(prompts)
            super().generate_sequences(prompts)

    AnnouncingAgentLoopManagerTQ.__module__ = __name__
    AnnouncingAgentLoopManagerTQ.__qualname__ = "AnnouncingAgentLoopManagerTQ"
    return AnnouncingAgentLoopManagerTQ
