"""The previous responses SPEC-RL reuses, as every trainer adapter reads and records them.

With a draft server (``HISTOSPEC_DRAFT_SERVER``), the store is a live mirror of its records
(:meth:`PreviousResponses.follow`), the same in every engine and process of the job, and a finished
response is published to it with its log-probs, slot and policy version: next epoch's previous
response is found whichever engine or worker the prompt lands on. Without one, each process keeps
what it recorded itself, which helps only when a prompt's samples come back to the same process.

One :class:`PreviousStore` per process (:func:`shared`): its mirrors and publishers are opened once
per address and used from the trainers' worker threads and event loops alike.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from histospec_sgl.specrl.client import Previous, PreviousResponses


class PreviousStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self.local = PreviousResponses()
        self._followers: dict[str, PreviousResponses] = {}
        self._publishers: dict[str, Any] = {}

    def follower(self, address: str) -> PreviousResponses:
        """The live mirror of the draft server at ``address`` (opened on first use)."""
        with self._lock:
            store = self._followers.get(address)
            if store is None:
                store = self._followers[address] = PreviousResponses.follow(address)
            return store

    def publisher(self, address: str) -> Any:
        with self._lock:
            pub = self._publishers.get(address)
            if pub is None:
                from histospec_sgl.sync.client import HistoryPublisher

                pub = self._publishers[address] = HistoryPublisher(address)
            return pub

    def get(self, address: str | None, group: int, slot: int) -> Previous | None:
        """The previous response of ``slot`` in ``group``: from the draft server's mirror, or without
        a server from what this process recorded (:meth:`record` fills one or the other)."""
        return (self.follower(address) if address else self.local).get(group, slot)

    def record(self, address: str | None, prompt_ids: Sequence[int], response_ids: Sequence[int],
               logprobs: Sequence[float] | None, finish_reason: str | None, *, group: int, slot: int,
               version: int, reward: float | None = None, flush: bool = True) -> bool:
        """Record a finished response: published to the draft server at ``address`` (``flush``: wait
        until it is acknowledged), else kept in this process when it has log-probs. An empty or
        aborted response is not recorded (returns False)."""
        if not response_ids or finish_reason == "abort":
            return False
        if address:
            pub = self.publisher(address)
            with self._publish_lock:
                pub.publish(list(prompt_ids), list(response_ids), group=group, version=version, sample_index=slot,
                            logprobs=None if logprobs is None else list(logprobs), reward=reward)
                if flush:
                    pub.flush()
        elif logprobs is not None:
            self.local.put(group, slot, Previous(list(response_ids), list(logprobs), finish_reason, version))
        return True


_SHARED: PreviousStore | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> PreviousStore:
    """This process's store."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PreviousStore()
        return _SHARED
